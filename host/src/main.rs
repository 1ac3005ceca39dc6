//! The `thorn` command line.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use thorn::store::{self, Progress, PullOutcome};
use thorn_engine::gguf::Gguf;
use thorn_engine::tokenizer::Tokenizer;
use thorn_guide::ToolGrammars;
use thorn_tools::chat::{ChatTemplate, Message};

#[macro_use]
mod log;
mod admin;
mod approvals;
mod bench;
mod estop;
mod opts;
mod place;
mod plugins;
mod serve;
mod terminal;

use bench::BenchCmd;
use opts::{EngineArgs, ModelArgs, SpecArgs, ToolFormatArgs};

#[derive(Parser)]
#[command(
    name = "thorn",
    version,
    about = "An agent host for the edge: LLM engine + sandboxed wasm tools"
)]
struct Cli {
    /// Model cache directory (default: $THORN_CACHE_DIR, $XDG_CACHE_HOME/thorn, ~/.cache/thorn).
    #[arg(long, global = true)]
    cache_dir: Option<PathBuf>,
    /// The form of what thorn writes to stderr: text, or one JSON object per line (status lines, request
    /// logs, warnings). `THORN_LOG` filters the log (e.g. `info`, `warn,thorn::access=off`).
    #[arg(long, global = true, value_enum, default_value_t = log::LogFormat::Text)]
    log_format: log::LogFormat,
    /// Send traces (a span per request, round and tool call) to this OTLP/HTTP collector, e.g.
    /// http://127.0.0.1:4318 (`/v1/traces` is appended).
    #[arg(long, global = true, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    /// The OTLP encoding.
    #[arg(long, global = true, value_enum, default_value_t = log::OtlpProtocol::HttpProtobuf)]
    otlp_protocol: log::OtlpProtocol,
    /// A CA certificate file (PEM) to trust besides the system's roots, for https:// upstreams, external
    /// MCP servers and the OTLP collector (repeatable).
    #[arg(long, global = true)]
    tls_ca: Vec<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Set up and run the main job: pull (or verify) the default model, then serve the OpenAI API with the
    /// installed plugins (`scripts/up` also builds and installs the example plugins first).
    Up(serve::ServeArgs),
    /// Generate a reply to one prompt, streaming it to stdout.
    Generate(GenerateArgs),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        cmd: BenchCmd,
    },
    /// Manage models.
    Model {
        #[command(subcommand)]
        cmd: ModelCmd,
    },
    /// Manage the data sets benchmarks read (BFCL v4).
    Data {
        #[command(subcommand)]
        cmd: DataCmd,
    },
    /// Serve the OpenAI-compatible API, with the installed plugins as host tools.
    Serve(serve::ServeArgs),
    /// Chat in the terminal with the model and the installed plugins.
    Chat {
        #[command(flatten)]
        agent: serve::AgentArgs,
        /// A system message.
        #[arg(long)]
        system: Option<String>,
        /// Sampling temperature (0 = greedy).
        #[arg(long, default_value_t = 0.7)]
        temperature: f32,
    },
    /// Run one task with the installed plugins and print the transcript.
    Run {
        /// The task.
        task: String,
        #[command(flatten)]
        agent: serve::AgentArgs,
        /// A system message.
        #[arg(long)]
        system: Option<String>,
    },
    /// Serve the installed plugins as MCP tools over stdio (for desktop agents that start their tools as
    /// a child process). Calls are validated, sandboxed, limited and audited as host tool calls are.
    Mcp {
        #[command(flatten)]
        place: plugins::Place,
        /// The conversation id the audit log records for these calls.
        #[arg(long, default_value = "mcp")]
        conversation: String,
        /// Seconds between looks at the plugin directory and policy: changes are served and the client
        /// is told (`notifications/tools/list_changed`); 0: load once.
        #[arg(long, default_value_t = 2)]
        plugin_poll: u64,
    },
    /// The running server's e-stop latch: `on` refuses every call that can move or change anything
    /// (stop and read-only functions still run), `off` releases it, `status` shows it.
    Estop {
        #[command(subcommand)]
        cmd: estop::EstopCmd,
        #[command(flatten)]
        server: admin::AdminArgs,
    },
    /// Calls the running server holds for a person's approval (the policy's `approval`): list them,
    /// approve or deny one.
    Approvals {
        #[command(subcommand)]
        cmd: approvals::ApprovalsCmd,
        #[command(flatten)]
        server: admin::AdminArgs,
    },
    /// Tool plugins: list, inspect, check, call, install, approve, grant.
    Plugins {
        #[command(flatten)]
        place: plugins::Place,
        #[command(subcommand)]
        cmd: plugins::Cmd,
    },
    /// Tokenize text with a model's tokenizer and print the ids.
    Tokenize {
        /// The text.
        text: String,
        /// Parse control-token text (`<|im_start|>`) as control tokens.
        #[arg(long)]
        special: bool,
        #[command(flatten)]
        model: ModelArgs,
    },
    /// Render a chat with the model's template and print the prompt and its token count.
    Render {
        /// The user message.
        prompt: String,
        /// A system message.
        #[arg(long)]
        system: Option<String>,
        /// A JSON file with OpenAI `tools` entries (a list), rendered as the model sees them.
        #[arg(long)]
        tools: Option<PathBuf>,
        #[command(flatten)]
        tool_format: ToolFormatArgs,
        #[command(flatten)]
        model: ModelArgs,
    },
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// The user message.
    #[arg(long, short)]
    prompt: String,
    /// A system message (default: the chat template's own).
    #[arg(long)]
    system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Top-k (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Top-p (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Min-p (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Repetition penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Random seed (same seed, same output).
    #[arg(long)]
    seed: Option<u64>,
    /// Stop string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// A JSON file with OpenAI `tools` entries (a list); calls are constrained to their schemas.
    #[arg(long)]
    tools: Option<PathBuf>,
    /// tool_choice: auto, none, required, or a function name.
    #[arg(long, default_value = "auto")]
    tool_choice: String,
    /// Allow only one tool call per answer.
    #[arg(long)]
    no_parallel_tool_calls: bool,
    #[command(flatten)]
    tool_format: ToolFormatArgs,
    /// A JSON file with a schema the answer must match (response_format json_schema), or `object` for any
    /// JSON object.
    #[arg(long)]
    json: Option<String>,
    /// Print speculation counters after the output.
    #[arg(long)]
    spec_stats: bool,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    spec: SpecArgs,
}

#[derive(Subcommand)]
enum DataCmd {
    /// Download a data set into the cache and verify every file's sha256.
    Pull {
        /// Data set name.
        #[arg(default_value = store::data::BFCL.name)]
        name: String,
        /// No progress output.
        #[arg(long, short)]
        quiet: bool,
    },
    /// List the known data sets and whether each is in the cache.
    List,
}

#[derive(Subcommand)]
enum ModelCmd {
    /// Download a model (default: the default model) into the cache and verify its sha256.
    Pull {
        /// Model name.
        #[arg(default_value = store::DEFAULT_MODEL.name)]
        name: String,
        /// No progress output.
        #[arg(long, short)]
        quiet: bool,
    },
    /// List models in the cache.
    List,
    /// Print a GGUF file's metadata and tensor summary.
    Info {
        /// File (default: the pulled default model).
        path: Option<PathBuf>,
        /// Also list every tensor.
        #[arg(long)]
        tensors: bool,
    },
}

/// Runs the command; an error is printed as the user's problem it is: its message and causes on one line,
/// `error: ...`, with no backtrace whatever `RUST_BACKTRACE` says, and exit status 1.
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    // One crypto provider for the process, before any TLS client or server is built; the roots before
    // any client (the OTLP exporter's is the first).
    thorn_plugin::tls::provider();
    thorn_plugin::tls::trust(&cli.tls_ca).context("--tls-ca")?;
    let _log = log::init(
        cli.log_format,
        cli.otlp_endpoint.as_deref().map(|e| (e, cli.otlp_protocol)),
    )?;
    let cache = store::cache_dir(cli.cache_dir.as_deref());
    match cli.cmd {
        Cmd::Up(a) => up(&cache, a),
        Cmd::Generate(args) => generate(&cache, args),
        Cmd::Bench { cmd } => bench::run(&cache, cmd),
        Cmd::Model {
            cmd: ModelCmd::Pull { name, quiet },
        } => pull(&cache, &name, quiet).map(drop),
        Cmd::Data {
            cmd: DataCmd::Pull { name, quiet },
        } => pull_data(&cache, &name, quiet).map(drop),
        Cmd::Data { cmd: DataCmd::List } => {
            for d in store::data::KNOWN {
                let state = match store::data::locate(&cache, d) {
                    Ok(p) => format!("pulled: {}", p.display()),
                    Err(_) => "not pulled".to_owned(),
                };
                println!(
                    "{:8} {:>6.1} MB  {} ({})\n         {state}",
                    d.name,
                    d.bytes() as f64 / 1e6,
                    d.about,
                    d.requirement
                );
            }
            Ok(())
        }
        Cmd::Model {
            cmd: ModelCmd::List,
        } => {
            let models = store::list(&cache)?;
            if models.is_empty() {
                println!(
                    "no models in {} (run `thorn model pull`)",
                    cache.join("models").display()
                );
            }
            for (p, len) in models {
                println!("{:>10.1} MB  {}", len as f64 / 1e6, p.display());
            }
            Ok(())
        }
        Cmd::Model {
            cmd: ModelCmd::Info { path, tensors },
        } => info(&resolve(&cache, path)?, tensors),
        Cmd::Plugins { place, cmd } => plugins::run(&cache, &place, cmd),
        Cmd::Estop { cmd, server } => estop::run(cmd, &server),
        Cmd::Approvals { cmd, server } => approvals::run(cmd, &server),
        Cmd::Mcp {
            place,
            conversation,
            plugin_poll,
        } => serve::mcp(&cache, &place, conversation, plugin_poll),
        Cmd::Serve(a) => serve::serve(&cache, a),
        Cmd::Chat {
            agent,
            system,
            temperature,
        } => terminal::chat(&cache, &agent, system.as_deref(), temperature),
        Cmd::Run {
            task,
            agent,
            system,
        } => terminal::run(&cache, &agent, &task, system.as_deref()),
        Cmd::Tokenize {
            text,
            special,
            model,
        } => {
            let g = open(&resolve(&cache, model.model)?)?;
            let tok = Tokenizer::from_gguf(&g)?;
            let ids = tok.encode(&text, special)?;
            println!("{ids:?}");
            eprintln!("{} tokens", ids.len());
            Ok(())
        }
        Cmd::Render {
            prompt,
            system,
            tools,
            tool_format,
            model,
        } => {
            let g = open(&resolve(&cache, model.model)?)?;
            let defs = match &tools {
                Some(p) => tool_list(p)?,
                None => Vec::new(),
            };
            let (text, n) = render(&g, system.as_deref(), &prompt, &defs, &tool_format)?;
            print!("{text}");
            eprintln!("{n} tokens");
            Ok(())
        }
    }
}

fn generate(cache: &std::path::Path, a: GenerateArgs) -> Result<()> {
    use std::io::Write;
    use thorn_engine::engine::{Engine, EngineConfig, Request};
    use thorn_engine::sample::SamplingParams;
    use thorn_tools::chat::{ChatTemplate, Message};
    use thorn_tools::{ResponseFormat, ToolChoice, ToolSet};
    let path = resolve(cache, a.model.model)?;
    let cfg = a.engine.apply(EngineConfig {
        speculation: a.spec.config(),
        ..opts::engine_defaults(cache)
    });
    let mut engine =
        Engine::load(&path, &cfg).with_context(|| format!("loading {}", path.display()))?;
    if cfg.speculation.enabled {
        engine.calibrate_speculation()?;
    }
    let defs = match &a.tools {
        Some(p) => tool_list(p)?,
        None => Vec::new(),
    };
    let tool_format = a
        .tool_format
        .resolve(engine.gguf().get_str("tokenizer.chat_template").ok());
    let tools = ToolSet::new(&defs)?.with_format(tool_format)?;
    let choice = ToolChoice::from_name(&a.tool_choice);
    let format = match a.json.as_deref() {
        None => ResponseFormat::Text,
        Some("object") => ResponseFormat::JsonObject,
        Some(p) => ResponseFormat::from_openai(&serde_json::json!({"type": "json_schema",
            "json_schema": {"name": "answer", "schema": read_json(std::path::Path::new(p))?}}))?,
    };
    let mut guide =
        engine
            .grammars()?
            .guide(&tools, &choice, !a.no_parallel_tool_calls, &format)?;
    let shown = if choice == ToolChoice::None {
        ToolSet::default()
    } else {
        ToolSet::new(&defs)?.with_format(tool_format)?
    };
    let g = engine.gguf();
    let template = ChatTemplate::new(
        g.get_str("tokenizer.chat_template")
            .context("the model has no chat template")?,
    )?;
    let mut messages: Vec<Message> = a
        .system
        .as_deref()
        .map(Message::system)
        .into_iter()
        .collect();
    messages.push(Message::user(a.prompt.as_str()));
    let tok = engine.tokenizer();
    let text_of = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("").to_owned();
    let prompt_text = shown.render(
        &template,
        &messages,
        &text_of(tok.bos()),
        &text_of(tok.eos()),
        &|s| tok.quote(s),
    )?;
    let prompt = engine.tokenizer().encode_rendered(&prompt_text)?;
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repetition_penalty: a.repeat_penalty,
        seed: a.seed,
        ..SamplingParams::default()
    };
    let req = Request {
        prompt,
        max_tokens: a.max_tokens,
        sampling,
        stop: a.stop,
        stop_tokens: vec![],
        ignore_eos: false,
        cancel: None,
        speculate: true,
        think_budget: None,
        shown_controls: thorn_guide::shown_controls(engine.tokenizer(), tools.format()),
    };
    let mut stdout = std::io::stdout().lock();
    let out = engine.generate_guided(&req, guide.as_mut(), &mut |t| {
        let _ = stdout.write_all(t.as_bytes());
        let _ = stdout.flush();
    })?;
    drop(stdout);
    let st = &out.stats;
    println!();
    if !tools.is_empty() && choice != ToolChoice::None {
        match tools.reply(tools.complete_prefix(&out.text)) {
            Ok(r) => {
                for c in &r.calls {
                    eprintln!(
                        "[tool call {}: {}({})]",
                        c.id, c.function.name, c.function.arguments
                    );
                }
            }
            Err(e) => eprintln!("[tool call rejected: {e}]"),
        }
    }
    eprintln!(
        "[{} prompt tokens: {:.1} tok/s prefill | {} tokens in {} decode passes: {:.1} tok/s decode | {} threads, {} | finish: {}]",
        st.prompt_tokens,
        st.prefill_tps(),
        st.generated,
        st.forward_passes,
        st.decode_tps(),
        engine.device().threads(),
        engine.device().name(),
        out.finish.as_str()
    );
    if a.spec_stats {
        let s = engine.spec_stats();
        eprintln!(
            "[speculation: {} trees, {} of {} tree tokens accepted ({:.0}%), {:.2} tokens per pass]",
            s.trees,
            s.accepted,
            s.drafted,
            100.0 * s.acceptance(),
            s.tokens_per_pass()
        );
    }
    Ok(())
}

fn resolve(cache: &std::path::Path, path: Option<PathBuf>) -> Result<PathBuf> {
    match path {
        Some(p) => Ok(p),
        None => Ok(store::default_model(cache)?),
    }
}

fn open(path: &std::path::Path) -> Result<Gguf> {
    Gguf::open(path).with_context(|| format!("loading {}", path.display()))
}

/// `--data`/`--bfcl-dir` if given, else the pulled BFCL data set (with a clear error if it was not pulled).
fn bfcl_dir(cache: &std::path::Path, flag: Option<PathBuf>) -> Result<PathBuf> {
    match flag {
        Some(p) => Ok(p),
        None => Ok(store::data::locate(cache, &store::data::BFCL)?),
    }
}

fn pull_data(cache: &std::path::Path, name: &str, quiet: bool) -> Result<PathBuf> {
    let spec = store::data::find(name)?;
    if !quiet {
        eprintln!(
            "data {} ({}, {} files, {:.1} MB) -> {}",
            spec.name,
            spec.requirement,
            spec.files.len(),
            spec.bytes() as f64 / 1e6,
            store::data::dir(cache, spec).display()
        );
    }
    let outcome = store::data::pull(spec, cache, &progress(quiet))?;
    Ok(pulled(
        outcome,
        quiet,
        "downloaded and verified (every file's sha256)",
    ))
}

fn pull(cache: &std::path::Path, name: &str, quiet: bool) -> Result<PathBuf> {
    let spec = store::find_spec(name)?;
    if !quiet {
        eprintln!(
            "model {} ({}) -> {}",
            spec.name,
            spec.requirement,
            cache.join("models").display()
        );
    }
    let outcome = store::pull(spec, cache, &progress(quiet))?;
    Ok(pulled(
        outcome,
        quiet,
        &format!("downloaded and verified (sha256 {})", spec.sha256),
    ))
}

/// Progress bars on stderr, unless `quiet`.
fn progress(quiet: bool) -> Progress {
    if quiet {
        Progress::hidden()
    } else {
        Progress::stderr()
    }
}

/// Says what a pull did (unless `quiet`) and gives the path it left.
fn pulled(outcome: PullOutcome, quiet: bool, downloaded: &str) -> PathBuf {
    let (path, what) = match outcome {
        PullOutcome::AlreadyPresent(p) => (p, "already present and verified"),
        PullOutcome::Downloaded(p) => (p, downloaded),
    };
    if !quiet {
        eprintln!("{what}: {}", path.display());
    }
    path
}

/// A JSON file's contents.
fn read_json(p: &std::path::Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not JSON", p.display()))
}

/// A JSON file's list of OpenAI `tools` entries.
fn tool_list(p: &std::path::Path) -> Result<Vec<serde_json::Value>> {
    match read_json(p)? {
        serde_json::Value::Array(v) => Ok(v),
        _ => anyhow::bail!("{}: expected a JSON list of tools", p.display()),
    }
}

/// A chat rendered as the model sees it: with `defs` (OpenAI `tools` entries) in the tool-call format
/// `format` asks for (the template's own rendering of tools where it has one).
fn render(
    g: &Gguf,
    system: Option<&str>,
    prompt: &str,
    defs: &[serde_json::Value],
    format: &ToolFormatArgs,
) -> Result<(String, usize)> {
    let tok = Tokenizer::from_gguf(g)?;
    let src = g
        .get_str("tokenizer.chat_template")
        .context("the model has no chat template")?;
    let template = ChatTemplate::new(src)?;
    let tools = thorn_tools::ToolSet::new(defs)?.with_format(format.resolve(Some(src)))?;
    let mut messages: Vec<Message> = system.map(Message::system).into_iter().collect();
    messages.push(Message::user(prompt));
    let text_of = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("").to_owned();
    let (bos, eos) = (text_of(tok.bos()), text_of(tok.eos()));
    let text = tools.render(&template, &messages, &bos, &eos, &|s| tok.quote(s))?;
    let n = tok.encode_rendered(&text)?.len();
    Ok((text, n))
}

fn info(path: &std::path::Path, tensors: bool) -> Result<()> {
    let g = open(path)?;
    println!("file      {}", path.display());
    println!(
        "format    GGUF v{}, {} metadata keys, {} tensors, alignment {}",
        g.version,
        g.metadata().len(),
        g.tensors().len(),
        g.alignment
    );
    println!(
        "size      {:.1} MB ({:.1} MB of tensor data)",
        g.file_len() as f64 / 1e6,
        g.tensor_bytes() as f64 / 1e6
    );
    let mut by_type: Vec<(String, usize, u64)> = Vec::new();
    for t in g.tensors() {
        match by_type.iter_mut().find(|(n, _, _)| n == t.ty.name()) {
            Some(e) => {
                e.1 += 1;
                e.2 += t.size;
            }
            None => by_type.push((t.ty.name().to_owned(), 1, t.size)),
        }
    }
    let types: Vec<String> = by_type
        .iter()
        .map(|(n, c, b)| format!("{n} x{c} ({:.1} MB)", *b as f64 / 1e6))
        .collect();
    println!("types     {}", types.join(", "));
    println!("metadata");
    for (k, v) in g.metadata() {
        println!("  {k:<44} {}", v.summary(100).replace('\n', "\\n"));
    }
    if tensors {
        println!("tensors");
        for t in g.tensors() {
            println!("  {:<32} {:<6} {:?}", t.name, t.ty.name(), t.dims);
        }
    }
    Ok(())
}

fn up(cache: &std::path::Path, a: serve::ServeArgs) -> Result<()> {
    let path = pull(cache, store::DEFAULT_MODEL.name, false)?;
    if a.agent.model.model.is_none() {
        status!("default model ready: {}", path.display());
    }
    let (dir, _) = a.agent.place.resolve();
    if !a.agent.place.no_plugins && thorn_plugin::components(&dir)?.is_empty() {
        status!(
            "no plugins installed in {} (scripts/install-plugins builds and installs the examples)",
            dir.display()
        );
    }
    serve::serve(cache, a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_declares_each_option_once() {
        // clap's own checks: no flag declared twice in one command, defaults that parse, and so on.
        Cli::command().debug_assert();
    }

    #[test]
    fn every_engine_command_defaults_to_the_one_context() {
        let generate = Cli::try_parse_from(["thorn", "generate", "-p", "hi"]).unwrap();
        let serve = Cli::try_parse_from(["thorn", "serve"]).unwrap();
        let spec = Cli::try_parse_from(["thorn", "bench", "spec"]).unwrap();
        let Cmd::Generate(g) = generate.cmd else {
            panic!("generate")
        };
        let Cmd::Serve(s) = serve.cmd else {
            panic!("serve")
        };
        let Cmd::Bench {
            cmd: BenchCmd::Spec(b),
        } = spec.cmd
        else {
            panic!("bench spec")
        };
        // The one default, unless the environment sets it (then for every command alike).
        let want = std::env::var("THORN_CONTEXT")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(opts::DEFAULT_CONTEXT);
        for context in [g.engine.context, s.agent.engine.context, b.engine.context] {
            assert_eq!(context, want);
        }
        // A flag still sets it per command.
        let Cmd::Serve(s) = Cli::try_parse_from(["thorn", "serve", "--context", "2048"])
            .unwrap()
            .cmd
        else {
            panic!("serve")
        };
        assert_eq!(s.agent.engine.context, 2048);
    }

    #[test]
    fn serve_help_lists_each_option_under_its_own_heading() {
        let mut cmd = Cli::command();
        let help = cmd
            .find_subcommand_mut("serve")
            .expect("serve")
            .render_long_help()
            .to_string();
        // The heading each option is listed under: the last line before it that ends in ':'.
        let heading_of = |flag: &str| {
            let at = help
                .find(&format!("      {flag} "))
                .or_else(|| help.find(&format!("      {flag}\n")))
                .unwrap_or_else(|| panic!("{flag} missing:\n{help}"));
            help[..at]
                .lines()
                .rev()
                .find(|l| !l.starts_with(' ') && l.ends_with(':'))
                .unwrap_or("")
                .to_owned()
        };
        for (flag, heading) in [
            ("--host", "Server:"),
            ("--port", "Server:"),
            ("--api-key", "Server:"),
            ("--max-body", "Server:"),
            ("--max-tool-rounds", "Agent:"),
            ("--max-tokens-default", "Agent:"),
            ("--plugins", "Plugins:"),
            ("--policy", "Plugins:"),
            ("--context", "Engine:"),
            ("--speculation", "Speculative decoding:"),
            ("--upstream", "Upstreams:"),
        ] {
            assert_eq!(heading_of(flag), heading, "{flag}");
        }
    }
}
