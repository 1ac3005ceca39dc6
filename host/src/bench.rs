//! `thorn bench ...`: the benchmark commands. Each benchmark's own flags are declared by thorn-bench beside
//! the code that reads them; this room adds the model, engine and speculation options the commands share
//! with the rest of the command line, resolves the defaults that live in the cache (the default model, the
//! pulled BFCL data set) and runs them.

use crate::opts::{DeviceArgs, EngineArgs, ModelArgs, SpecArgs};
use crate::{bfcl_dir, resolve};
use anyhow::Result;
use clap::Subcommand;
use std::path::{Path, PathBuf};

#[derive(Subcommand)]
pub enum BenchCmd {
    /// Prefill and decode speed of the engine itself (the llama-bench shape: pp, tg, tg at depth).
    Engine {
        #[command(flatten)]
        bench: thorn_bench::EngineBench,
        #[command(flatten)]
        device: DeviceArgs,
        #[command(flatten)]
        model: ModelArgs,
    },
    /// Schema-constrained tool calls over the BFCL questions: validity, compile and mask times, forced
    /// tokens, and decode speed with vs without the grammar.
    Grammar {
        #[command(flatten)]
        bench: thorn_bench::grammar::Opts,
        #[command(flatten)]
        model: ModelArgs,
    },
    /// BFCL v4 accuracy of an OpenAI-compatible endpoint (AST checker; MLPerf sample with --mlperf).
    Bfcl(thorn_bench::bfcl::run::Opts),
    /// The MLPerf Edge Agentic replay (teacher-forced SWE-agent conversations) against an endpoint.
    Agentic(thorn_bench::agentic::Opts),
    /// Tool use out of the box: 40 tasks over the five example plugins and 10 prompts that need no tool,
    /// against a thorn endpoint with the plugins installed (`scripts/up`).
    Tasks(thorn_bench::tasks::Opts),
    /// Speculative decoding: tokens per forward pass and decode speed with no speculation, a 3-token chain
    /// and the draft tree, on BFCL tool calls and the replay set's assistant turns.
    Spec(SpecBenchArgs),
    /// Chart TTFT per turn against context length from agentic reports (one series each).
    Chart {
        /// Agentic JSON reports, each `FILE` or `LABEL=FILE`.
        #[arg(required = true)]
        reports: Vec<String>,
        /// The SVG to write.
        #[arg(long, default_value = "ttft.svg")]
        out: PathBuf,
    },
}

/// `thorn bench spec`: its own flags and the model, engine and speculation options.
#[derive(clap::Args)]
pub struct SpecBenchArgs {
    #[command(flatten)]
    pub bench: thorn_bench::spec::Opts,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Threads and context (turns that do not fit the context are skipped).
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
}

/// Runs a benchmark command.
pub fn run(cache: &Path, cmd: BenchCmd) -> Result<()> {
    match cmd {
        BenchCmd::Chart { reports, out } => {
            let series = reports
                .iter()
                .map(|r| thorn_bench::chart::series(r))
                .collect::<Result<Vec<_>>>()?;
            thorn_bench::chart::draw(&series, &out)?;
            eprintln!("wrote {}", out.display());
            Ok(())
        }
        BenchCmd::Spec(a) => {
            let model = resolve(cache, a.model.model)?;
            thorn_bench::spec::run(
                &a.bench,
                &thorn_bench::spec::Setup {
                    model: &model,
                    bfcl_dir: &bfcl_dir(cache, a.bench.bfcl_dir.clone())?,
                    context: a.engine.context,
                    threads: a.engine.device.threads,
                    tree: thorn_engine::spec::SpecConfig {
                        enabled: true,
                        ..a.spec.config()
                    },
                },
            )
        }
        BenchCmd::Bfcl(a) => thorn_bench::bfcl::run::run(&a, &bfcl_dir(cache, a.data.clone())?),
        BenchCmd::Agentic(a) => {
            thorn_bench::agentic::run(&a, &resolve(cache, a.tokenizer_model.clone())?)
        }
        BenchCmd::Tasks(a) => thorn_bench::tasks::run(&a),
        BenchCmd::Grammar { bench, model } => {
            let model = resolve(cache, model.model)?;
            thorn_bench::grammar::run(&bench, &model, &bfcl_dir(cache, bench.bfcl_dir.clone())?)
        }
        BenchCmd::Engine {
            bench,
            device,
            model,
        } => thorn_bench::engine(
            &resolve(cache, model.model)?,
            &bench,
            // A GPU's compiled kernels are cached under `--cache-dir`, as for every other command.
            &thorn_engine::engine::EngineConfig {
                device: device.device,
                threads: device.threads,
                attention: device.attention,
                ..crate::opts::engine_defaults(cache)
            },
        ),
    }
}
