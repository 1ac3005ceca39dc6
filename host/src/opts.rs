//! The command line's option groups, one per concern, shared by every command that needs them: the model
//! file ([`ModelArgs`]), the engine ([`EngineArgs`]: the device and threads ([`DeviceArgs`]), context), the
//! KV cache ([`KvArgs`]) and speculative decoding ([`SpecArgs`]). The server's own options are in
//! `serve.rs`. Each option can also be set through the environment variable named in its help (`THORN_*`);
//! a flag wins over the variable.

use std::path::{Path, PathBuf};
use thorn_engine::backend::{AttentionMath, DeviceKind};
use thorn_engine::engine::EngineConfig;
use thorn_engine::kv::{KvConfig, KvDtype};
use thorn_engine::spec::{FixedCost, SpecConfig};

/// The context length every command defaults to, in tokens.
pub const DEFAULT_CONTEXT: usize = 8192;

/// The engine configuration every command starts from: the defaults, with a GPU's compiled kernels cached
/// in `kernels/` under thorn's cache directory (`cache`: `--cache-dir`, else the environment's).
pub fn engine_defaults(cache: &Path) -> EngineConfig {
    EngineConfig {
        kernel_cache: Some(cache.join("kernels")),
        ..EngineConfig::default()
    }
}

/// Which model file to load.
#[derive(clap::Args, Debug, Clone, Default)]
#[command(next_help_heading = "Model")]
pub struct ModelArgs {
    /// Model file (default: the pulled default model).
    #[arg(long, env = "THORN_MODEL")]
    pub model: Option<PathBuf>,
}

/// How the engine runs.
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "Engine")]
pub struct EngineArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    /// CUDA graphs on a GPU: the launches of a decode step are captured once and replayed as one graph
    /// (`false`: each kernel is launched as it is queued).
    #[arg(long, env = "THORN_CUDA_GRAPHS", default_value_t = true, action = clap::ArgAction::Set)]
    pub cuda_graphs: bool,
    /// Context length in tokens.
    #[arg(long, env = "THORN_CONTEXT", default_value_t = DEFAULT_CONTEXT)]
    pub context: usize,
}

/// Where the engine runs: the device and its CPU threads (the engine options `thorn bench engine` takes
/// too).
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "Engine")]
pub struct DeviceArgs {
    /// The device the model runs on: `cpu`, `cuda` or `cuda:N` (a build without the CUDA backend, or a
    /// machine without a usable GPU, says which and stops), or `auto` (GPU 0 when one can be used, else
    /// the CPU, with a log line saying why).
    #[arg(long, env = "THORN_DEVICE", default_value = "cpu")]
    pub device: DeviceKind,
    /// CPU threads (0 = one per physical core).
    #[arg(long, env = "THORN_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// The CPU attention kernels' products: `f32`, or `bf16` where the CPU has AVX-512 BF16 (queries,
    /// keys, values and softmax weights rounded to bf16, sums in f32: 1.5x faster prefill at depth, its
    /// accuracy in BENCHMARKS.md).
    #[arg(long, env = "THORN_ATTENTION", default_value = "f32")]
    pub attention: AttentionMath,
}

impl EngineArgs {
    /// Applies these options to an engine configuration.
    pub fn apply(&self, cfg: EngineConfig) -> EngineConfig {
        EngineConfig {
            device: self.device.device,
            threads: self.device.threads,
            attention: self.device.attention,
            cuda_graphs: self.cuda_graphs,
            context: self.context,
            ..cfg
        }
    }
}

/// KV cache options.
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "KV cache")]
pub struct KvArgs {
    /// KV cache element type: f16, f32 or fp8 (E4M3 with a scale per page and head).
    #[arg(long, env = "THORN_KV_DTYPE", default_value = "f16")]
    pub kv_dtype: KvDtype,
    /// KV cache memory budget, e.g. 512M or 2G (0 = room for four full contexts).
    #[arg(long, env = "THORN_KV_MEMORY", default_value = "0", value_parser = parse_bytes)]
    pub kv_memory: usize,
    /// Positions per KV page.
    #[arg(long, env = "THORN_PAGE_SIZE", default_value_t = KvConfig::PAGE_SIZE)]
    pub page_size: usize,
    /// Keep only prompts in the prefix cache, not generated tokens.
    #[arg(long)]
    pub no_cache_output: bool,
}

impl KvArgs {
    /// Applies these options to an engine configuration.
    pub fn apply(&self, cfg: EngineConfig) -> EngineConfig {
        EngineConfig {
            kv_dtype: self.kv_dtype,
            kv_memory: self.kv_memory,
            page_size: self.page_size,
            cache_output: !self.no_cache_output,
            ..cfg
        }
    }
}

/// Speculative decoding options.
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "Speculative decoding")]
pub struct SpecArgs {
    /// Speculative decoding: `tree` (drafts shaped by measured cost), `chain` (top-1 only) or `off`.
    /// Output is the same either way; requests may opt out with `"speculation": false`.
    #[arg(long, env = "THORN_SPECULATION", default_value = "tree")]
    pub speculation: SpecMode,
    /// Children per draft-tree node.
    #[arg(long, default_value_t = 2)]
    pub spec_top_k: usize,
    /// Deepest drafted token.
    #[arg(long, default_value_t = 8)]
    pub spec_depth: usize,
    /// Most drafted tokens per tree (grammar-forced runs come on top).
    #[arg(long, default_value_t = 16)]
    pub spec_nodes: usize,
    /// Always use the whole budget instead of sizing trees by the measured cost of verification.
    #[arg(long)]
    pub spec_fixed: bool,
    /// Size trees by a fixed cost model instead of measuring this machine: `STEP,TOKEN`, the cost of a
    /// one-token pass and of each further token (e.g. `1,0.02` for a memory-bound GPU). Tree shapes then
    /// never depend on the machine's load.
    #[arg(long, env = "THORN_SPEC_COST", value_parser = parse_fixed_cost)]
    pub spec_cost: Option<FixedCost>,
}

fn parse_fixed_cost(s: &str) -> Result<FixedCost, String> {
    let (a, b) = s
        .split_once(',')
        .ok_or_else(|| format!("{s:?}: expected STEP,TOKEN (e.g. 1,0.02)"))?;
    let num = |x: &str| {
        x.trim()
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v >= 0.0)
            .ok_or_else(|| format!("{x:?} is not a non-negative number"))
    };
    let (step, token) = (num(a)?, num(b)?);
    if step <= 0.0 {
        return Err("the cost of a one-token pass must be positive".into());
    }
    Ok(FixedCost { step, token })
}

/// `--speculation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SpecMode {
    /// Draft trees.
    Tree,
    /// Draft chains.
    Chain,
    /// No speculation.
    Off,
}

impl SpecArgs {
    /// The speculation configuration these options give.
    pub fn config(&self) -> SpecConfig {
        let base = SpecConfig::default();
        SpecConfig {
            enabled: self.speculation != SpecMode::Off,
            top_k: if self.speculation == SpecMode::Chain {
                1
            } else {
                self.spec_top_k.max(1)
            },
            max_depth: self.spec_depth,
            max_nodes: self.spec_nodes,
            adaptive: !self.spec_fixed,
            fixed_cost: self.spec_cost,
            ..base
        }
    }
}

/// `512M`, `2G`, `1.5GiB`, `1000000` (bytes; K/M/G/T are powers of 1024).
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 512M or 2G)"))?;
    let mult = match unit
        .trim()
        .to_ascii_uppercase()
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" => 1u64,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        "T" => 1 << 40,
        u => return Err(format!("unknown size unit {u:?} in {s:?} (K, M, G or T)")),
    };
    Ok((n * mult as f64) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--cache-dir` (a global flag) is where a command's engine caches a GPU's compiled kernels.
    #[test]
    fn the_cache_dir_flag_is_where_the_engine_caches_kernels() {
        use clap::Parser;
        let args = ["thorn", "generate", "-p", "hi", "--cache-dir", "/x/thorn"];
        let cli = crate::Cli::try_parse_from(args).unwrap();
        let cache = thorn::store::cache_dir(cli.cache_dir.as_deref());
        let cfg = engine_defaults(&cache);
        assert_eq!(cfg.kernel_cache, Some(PathBuf::from("/x/thorn/kernels")));
    }

    #[test]
    fn sizes_parse_in_powers_of_1024() {
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("2G"), Ok(2 << 30));
        assert_eq!(parse_bytes("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("1000000"), Ok(1_000_000));
        assert!(parse_bytes("12Q").is_err());
        assert!(parse_bytes("lots").is_err());
    }

    #[test]
    fn a_fixed_cost_needs_a_positive_step() {
        let c = parse_fixed_cost("1,0.02").unwrap();
        assert_eq!((c.step, c.token), (1.0, 0.02));
        assert!(parse_fixed_cost("0,1").is_err());
        assert!(parse_fixed_cost("1").is_err());
        assert!(parse_fixed_cost("1,-2").is_err());
    }
}

/// How the model writes tool calls.
#[derive(clap::Args, Debug, Clone, Default)]
#[command(next_help_heading = "Tool use")]
pub struct ToolFormatArgs {
    /// The tool-call format the model writes: `auto` (detected from its chat template), `hermes`
    /// (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`), `qwen3_xml` (Qwen3's
    /// `<function=NAME><parameter=KEY>` blocks), `llama3_json` (Llama 3's bare `{"name": ...,
    /// "parameters": ...}`), `mistral` (`[TOOL_CALLS][{"name": ..., "arguments": ...}]`), `mistral_args`
    /// (`[TOOL_CALLS]NAME[ARGS]{...}`), `harmony` (gpt-oss's messages on channels: `to=functions.NAME ...
    /// <|message|>{...}`), `gemma` (Gemma 4's `<|tool_call>call:NAME{key:value}<tool_call|>`) or
    /// `functiongemma`. The grammar, the parser, the streamed deltas and where reasoning is read follow it.
    #[arg(long, env = "THORN_TOOL_FORMAT", default_value = "auto", value_parser = parse_tool_format)]
    pub tool_format: ToolFormatChoice,
}

/// `--tool-format`: a named format, or the chat template's.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub enum ToolFormatChoice {
    /// Detected from the chat template.
    #[default]
    Auto,
    /// This one.
    Named(thorn_tools::ToolFormat),
}

impl ToolFormatArgs {
    /// The format for a model whose chat template is `template` (its source, if it has one).
    pub fn resolve(&self, template: Option<&str>) -> thorn_tools::ToolFormat {
        match self.tool_format {
            ToolFormatChoice::Named(f) => f,
            ToolFormatChoice::Auto => template
                .map(thorn_tools::ToolFormat::detect)
                .unwrap_or_default(),
        }
    }
}

fn parse_tool_format(s: &str) -> Result<ToolFormatChoice, String> {
    if s == "auto" {
        return Ok(ToolFormatChoice::Auto);
    }
    thorn_tools::ToolFormat::from_name(s)
        .map(ToolFormatChoice::Named)
        .map_err(|e| e.to_string())
}

/// `--reasoning`: whether a thinking model reasons when a request does not say.
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq)]
pub enum ReasoningArg {
    /// As its chat template does by default.
    #[default]
    Auto,
    /// Reasoning on (the template's `enable_thinking` true).
    On,
    /// Reasoning off (`enable_thinking` false: Qwen3's template closes an empty think block).
    Off,
}

impl ReasoningArg {
    /// The template's `enable_thinking` default (`None`: the template's own).
    pub fn enable_thinking(self) -> Option<bool> {
        match self {
            ReasoningArg::Auto => None,
            ReasoningArg::On => Some(true),
            ReasoningArg::Off => Some(false),
        }
    }
}
