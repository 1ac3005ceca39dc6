//! `thorn serve` and `thorn mcp`, and the agent every command builds: the model, the installed plugins,
//! their live reload. (`thorn chat` and `thorn run` are in `terminal.rs`.)

use crate::opts::{
    EngineArgs, KvArgs, ModelArgs, ReasoningArg, SpecArgs, ToolFormatArgs, parse_bytes,
};
use crate::plugins::Place;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use thorn::agent::Agent;
use thorn::api::mcp::McpHttp;
use thorn::api::{AppState, HttpLimits, ServerConfig};
use thorn::auth::Keys;
use thorn::upstream::{UpstreamSpec, Upstreams};
use thorn_engine::engine::{Engine, EngineConfig};
use thorn_plugin::{Controls, Estop};
use thorn_plugin::{Fingerprint, GrammarCheck, HostConfig, LiveSet, PluginHost, PluginSet, Policy};

/// What every agent command takes.
#[derive(clap::Args, Clone)]
pub struct AgentArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The name the model is served under (default: the default model's name, else the file's stem).
    #[arg(long, help_heading = "Model")]
    pub model_name: Option<String>,
    #[command(flatten)]
    pub place: Place,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Most rounds of host tool calls per request (a request may ask for fewer, never more).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..), help_heading = "Agent")]
    pub max_tool_rounds: u32,
    /// Most host tool calls per request, all rounds together; later calls are not run.
    #[arg(long, default_value_t = 32, help_heading = "Agent")]
    pub max_host_calls: usize,
    /// Most tokens a round generates when its request sets no `max_tokens` (0: up to the context).
    #[arg(long, default_value_t = 1024, help_heading = "Agent")]
    pub max_tokens_default: usize,
    /// Most tokens any round generates, whatever its request asks (0: no bound but the context).
    #[arg(long, default_value_t = 0, help_heading = "Agent")]
    pub max_tokens_limit: usize,
    /// Requests that may wait for the engine before new ones get 429.
    #[arg(long, default_value_t = 32)]
    pub queue: usize,
    /// Most sequences generating at once (continuous batching).
    #[arg(long, default_value_t = 8)]
    pub max_batch: usize,
    /// Most tokens per forward pass: running decodes always fit, prompt chunks fill the rest.
    #[arg(long, default_value_t = 256)]
    pub step_tokens: usize,
    /// Let `/v1/completions` prompts spell control tokens (`<|im_start|>`). Off by default: a raw
    /// prompt's control-token text is ordinary text. Chat messages are always data.
    #[arg(long, help_heading = "Agent")]
    pub completions_special: bool,
    #[command(flatten)]
    pub kv: KvArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Host tools on a small model: route each user message to the host functions it is about (or to
    /// none) and force the call (`lexical`), or show the model every requested tool (`off`). Applies to
    /// requests whose tools are all host tools, with tool_choice auto.
    #[arg(long, default_value = "lexical", help_heading = "Tool use")]
    pub tool_routing: thorn::agent::Routing,
    /// Show the model the plugins' example calls for the functions it is offered (at most 3 functions).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, help_heading = "Tool use")]
    pub tool_examples: bool,
    /// Who words the answer after a routed call: the function's answer template (`template`, where it
    /// has one) or the model (`model`).
    #[arg(long, default_value = "template", help_heading = "Tool use")]
    pub tool_answers: thorn::agent::Answers,
    #[command(flatten)]
    pub tool_format: ToolFormatArgs,
    /// Whether a thinking model reasons when a request does not say (`reasoning_effort`,
    /// `chat_template_kwargs.enable_thinking`, Anthropic's `thinking`): `auto` (as its chat template
    /// does), `on` or `off` (the template's `enable_thinking`).
    #[arg(
        long,
        env = "THORN_REASONING",
        default_value = "auto",
        help_heading = "Tool use"
    )]
    pub reasoning: ReasoningArg,
    /// Most tokens a thinking model writes inside its think block before thorn closes it for the model,
    /// when a request does not say (Anthropic's `thinking.budget_tokens` does); unset: no limit.
    #[arg(long, env = "THORN_REASONING_BUDGET", help_heading = "Tool use")]
    pub reasoning_budget: Option<usize>,
}

impl AgentArgs {
    /// The tool-use policy the flags ask for.
    pub fn tool_use(&self) -> thorn::agent::ToolUse {
        thorn::agent::ToolUse {
            routing: self.tool_routing,
            examples: self.tool_examples,
            answers: self.tool_answers,
        }
    }
}

/// `thorn serve`.
#[derive(clap::Args)]
#[command(next_help_heading = "Server")]
pub struct ServeArgs {
    #[command(flatten)]
    pub agent: AgentArgs,
    /// Address to listen on.
    #[arg(
        long,
        env = "THORN_HOST",
        default_value = "127.0.0.1",
        help_heading = "Server"
    )]
    pub host: String,
    /// Port.
    #[arg(
        long,
        env = "THORN_PORT",
        default_value_t = 8080,
        help_heading = "Server"
    )]
    pub port: u16,
    /// Serve HTTPS with this certificate chain (PEM, leaf first); needs --tls-key. SIGHUP reads both
    /// files again (open connections keep theirs).
    #[arg(long, requires = "tls_key", help_heading = "Server")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, requires = "tls_cert", help_heading = "Server")]
    pub tls_key: Option<PathBuf>,
    /// Accepted API key (repeatable; also $THORN_API_KEYS, comma-separated). None: no authentication.
    #[arg(long, help_heading = "Server")]
    pub api_key: Vec<String>,
    /// API key file: ids, key digests, per-key host-tool allow-lists and /metrics rights (see
    /// `thorn::auth`).
    #[arg(long, env = "THORN_API_KEY_FILE", help_heading = "Server")]
    pub api_keys: Option<PathBuf>,
    /// Require a key allowed to read it for GET /metrics (keys from --api-key may).
    #[arg(long, help_heading = "Server")]
    pub metrics_auth: bool,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 8 << 20, help_heading = "Server")]
    pub max_body: usize,
    /// Most connections served at once (more wait in the kernel's backlog).
    #[arg(long, default_value_t = 256, help_heading = "Server")]
    pub max_connections: usize,
    /// Seconds a connection has to send a request's headers (idle keep-alive connections close after it).
    #[arg(long, default_value_t = 10, help_heading = "Server")]
    pub header_timeout: u64,
    /// Seconds a request has to send its whole body.
    #[arg(long, default_value_t = 30, help_heading = "Server")]
    pub body_timeout: u64,
    /// Bytes of request bodies being read at once, all clients together (beyond it: 503).
    #[arg(long, default_value = "256M", value_parser = parse_bytes, help_heading = "Server")]
    pub max_inflight_body: usize,
    /// Seconds until a response must start (0: no limit); a streamed one starts once admitted.
    #[arg(long, default_value_t = 0, help_heading = "Server")]
    pub request_timeout: u64,
    /// Seconds running requests may go on after SIGINT or SIGTERM; then each still running is cut (a
    /// stream ends with a `shutting_down` error event and `[DONE]`). A second signal cuts at once.
    #[arg(long, default_value_t = 10, help_heading = "Server")]
    pub shutdown_grace: u64,
    /// Seconds between looks at the plugin directory and policy: a plugin installed, approved or
    /// removed while thorn runs is served (or dropped) without a restart, and MCP clients are told
    /// (0: load once at start).
    #[arg(long, default_value_t = 2, help_heading = "Server")]
    pub plugin_poll: u64,
    /// Do not serve `/mcp` (thorn's tools over MCP's Streamable HTTP).
    #[arg(long, help_heading = "MCP")]
    pub no_mcp: bool,
    /// A `Host` `/mcp` accepts besides loopback (`name` or `name:port`; repeatable): the name remote
    /// MCP clients reach this server by. Others get 403 (DNS rebinding).
    #[arg(long, help_heading = "MCP")]
    pub mcp_allowed_host: Vec<String>,
    /// A browser origin allowed to call `/mcp` (`https://app.example:443`, `http://localhost:*`;
    /// repeatable). By default a request carrying any `Origin` is refused.
    #[arg(long, help_heading = "MCP")]
    pub mcp_allowed_origin: Vec<String>,
    /// Most MCP sessions open at once.
    #[arg(long, default_value_t = 256, help_heading = "MCP")]
    pub mcp_max_sessions: usize,
    /// Most MCP sessions one API key holds at once (so one client cannot take them all).
    #[arg(long, default_value_t = 32, help_heading = "MCP")]
    pub mcp_max_sessions_per_key: usize,
    /// Most MCP sessions one client address holds at once.
    #[arg(long, default_value_t = 16, help_heading = "MCP")]
    pub mcp_max_sessions_per_peer: usize,
    /// An OpenAI-compatible engine behind thorn's agent loop (vLLM, SGLang, llama-server, another
    /// thorn): `NAME=URL[,OPTION=VALUE...]`, repeatable. Its models are served as `NAME/MODEL`; host
    /// tools stay local and sandboxed. Options: key_env, key_file, models, connect_timeout, timeout,
    /// idle_timeout, max_concurrent, max_response, health_interval, failures, cooldown (see README
    /// "Upstream engines").
    #[arg(long, help_heading = "Upstreams")]
    pub upstream: Vec<String>,
    /// Serve locally first, and send a request to this upstream when its prompt outgrows the local
    /// context or the local queue is full; clients ask for it with `model: "auto"` (or no model), and
    /// for its model outright with `thorn_model_class: "large"`.
    #[arg(long, value_name = "NAME", help_heading = "Upstreams")]
    pub local_first: Option<String>,
}

/// Loads the model onto its engine thread and the plugins under the policy.
pub fn build_agent(cache: &Path, a: &AgentArgs, controls: &Controls) -> Result<Agent> {
    let default = thorn::store::default_model(cache);
    let (path, default_name) = match &a.model.model {
        Some(p) => (p.clone(), None),
        None => (default?, Some(thorn::store::DEFAULT_MODEL.name)),
    };
    let name = a.model_name.clone().unwrap_or_else(|| {
        default_name.map_or_else(
            || {
                path.file_stem()
                    .map_or("model".into(), |s| s.to_string_lossy().into_owned())
            },
            str::to_owned,
        )
    });
    let cfg = a.kv.apply(a.engine.apply(EngineConfig {
        speculation: a.spec.config(),
        ..crate::opts::engine_defaults(cache)
    }));
    let mut engine =
        Engine::load(&path, &cfg).with_context(|| format!("loading {}", path.display()))?;
    if cfg.speculation.enabled {
        // Measure what verification costs here, so the first draft trees are shaped by it.
        engine
            .calibrate_speculation()
            .context("measuring forward passes for speculation")?;
    }
    let (context, threads) = (engine.context(), engine.device().threads());
    let kv = engine.kv_stats();
    status!(
        "KV cache: {} pages of {} positions ({}, {:.0} MiB)",
        kv.pages_total,
        kv.page_size,
        engine.kv_config().dtype.name(),
        (kv.pages_total * kv.page_bytes) as f64 / (1u64 << 20) as f64
    );
    let tool_format = a
        .tool_format
        .resolve(engine.gguf().get_str("tokenizer.chat_template").ok());
    status!("tool calls: {tool_format} format");
    let check = grammar_check(engine.tokenizer_arc())?;
    let (plugins, dir) = load_plugins(cache, &a.place, None, Some(&*check), controls)?;
    status!(
        "model {name} ({context} tokens of context, {threads} threads); {} plugin(s){} with {} tool(s) from {}",
        plugins.plugins().len(),
        servers_note(&plugins),
        plugins.tools().tools().len(),
        dir.display()
    );
    Ok(Agent::start_with(
        engine,
        name,
        Arc::new(plugins),
        a.queue,
        a.max_tool_rounds as usize,
        thorn_engine::engine::scheduler::SchedulerConfig {
            max_batch: a.max_batch,
            step_tokens: a.step_tokens,
        },
    )?
    .with_raw_special(a.completions_special)
    .with_max_host_calls(a.max_host_calls)
    .with_output_limits(thorn::agent::OutputLimits {
        default: (a.max_tokens_default > 0).then_some(a.max_tokens_default),
        limit: (a.max_tokens_limit > 0).then_some(a.max_tokens_limit),
    })
    .with_tool_use(a.tool_use())
    .with_tool_format(tool_format)
    .with_reasoning(a.reasoning.enable_thinking())
    .with_reasoning_budget(a.reasoning_budget))
}

/// The plugins in `place` that its policy admits (each refusal printed), and their directory; `previous`
/// is the set they replace, if any (its audit log is kept).
fn load_plugins(
    cache: &Path,
    place: &Place,
    previous: Option<&PluginSet>,
    grammar: Option<&GrammarCheck>,
    controls: &Controls,
) -> Result<(PluginSet, PathBuf)> {
    if place.no_plugins {
        return Ok((PluginSet::default(), PathBuf::from("(none: --no-plugins)")));
    }
    let (dir, policy_path) = place.resolve();
    let host = PluginHost::with_config(HostConfig {
        cache_dir: Some(cache.join("cwasm")),
        ..HostConfig::default()
    })?
    .with_controls(controls);
    let policy = Policy::load(&policy_path)?;
    let plugins = PluginSet::load_checked(&host, &dir, &policy, previous, grammar)?;
    for r in plugins.refused() {
        status_warn!("plugin refused: {}: {}", r.path.display(), r.error);
    }
    Ok((plugins, dir))
}

/// Whether the decoding grammar of the model with tokenizer `tok` can take a tool: the grammar a request
/// forcing a call of just that tool compiles to.
pub fn grammar_check(tok: Arc<thorn_engine::tokenizer::Tokenizer>) -> Result<Arc<GrammarCheck>> {
    let factory = thorn_engine::sample::grammar::GrammarFactory::new(tok)?;
    Ok(Arc::new(move |tools: &thorn_tools::ToolSet, name: &str| {
        let lark = thorn_tools::grammar::calls_grammar(tools, Some(name), false, None);
        factory
            .lark_uncached(&lark)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }))
}

/// ` and N external MCP server(s) (not sandboxed)`, when the policy names any.
fn servers_note(plugins: &PluginSet) -> String {
    match plugins.servers().len() {
        0 => String::new(),
        n => format!(" and {n} external MCP server(s) (not sandboxed)"),
    }
}

/// Keeps `live` in step with `place`: every `every`, when the plugin directory or the policy changed,
/// loads the set anew and serves it (a set that fails to load is reported and the old one kept). Runs on
/// its own thread: loading compiles components, which must not stall the async workers.
pub fn watch_plugins(
    cache: &Path,
    place: &Place,
    live: Arc<LiveSet>,
    every: Duration,
    grammar: Option<Arc<GrammarCheck>>,
    controls: Controls,
) {
    if every.is_zero() || place.no_plugins {
        return;
    }
    let (cache, place) = (cache.to_owned(), place.clone());
    let (dir, policy) = place.resolve();
    let mut seen = Fingerprint::of(&dir, &policy);
    let spawned = std::thread::Builder::new()
        .name("thorn-plugin-watch".into())
        .spawn(move || {
            loop {
                std::thread::sleep(every);
                let now = Fingerprint::of(&dir, &policy);
                if now == seen {
                    continue;
                }
                seen = now;
                let previous = live.current();
                match load_plugins(
                    &cache,
                    &place,
                    Some(&previous),
                    grammar.as_deref(),
                    &controls,
                ) {
                    Ok((set, _)) => {
                        let (n, tools) = (set.plugins().len(), set.tools().tools().len());
                        let changed = live.replace(Arc::new(set));
                        status!(
                            "plugins reloaded: {n} plugin(s) with {tools} tool(s){}",
                            if changed {
                                " (the tool list changed)"
                            } else {
                                ""
                            }
                        );
                    }
                    Err(e) => {
                        status_warn!("plugins not reloaded (still serving the old set): {e:#}")
                    }
                }
            }
        });
    if let Err(e) = spawned {
        status_warn!("warning: cannot watch the plugins for changes: {e}");
    }
}

/// `thorn mcp`: the admitted plugins as MCP tools over stdio. Stdout carries only the protocol; what
/// thorn has to say goes to stderr.
pub fn mcp(cache: &Path, place: &Place, conversation: String, plugin_poll: u64) -> Result<()> {
    place.check()?;
    use rmcp::ServiceExt;
    thorn_plugin::validate_conversation_id(&conversation)?;
    // No model here: the policy's external MCP servers are for the agent, and are not started.
    let controls = place.controls();
    let (plugins, dir) = load_plugins(cache, place, None, None, &controls)?;
    status!(
        "thorn mcp: {} plugin(s) with {} tool(s) from {} on stdio",
        plugins.plugins().len(),
        plugins.tools().tools().len(),
        dir.display()
    );
    let caller = thorn_plugin::Caller {
        conversation: Some(conversation),
        key_id: None,
        peer: Some("mcp-stdio".into()),
        request: None,
    };
    let live = Arc::new(LiveSet::new(Arc::new(plugins)));
    watch_plugins(
        cache,
        place,
        Arc::clone(&live),
        Duration::from_secs(plugin_poll),
        None,
        controls,
    );
    let tools = thorn::mcp::McpTools::new(live, caller);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let running = tools.serve(thorn::mcp::stdio::transport()).await?;
        running.waiting().await?;
        anyhow::Ok(())
    })
}

/// SIGUSR1 latches the e-stop (a wired button or a watchdog can send it; releasing is always a
/// decision, through the API or `thorn estop off`).
fn latch_on_sigusr1(estop: Arc<Estop>) -> Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut usr1 = signal(SignalKind::user_defined1()).context("listening for SIGUSR1")?;
        tokio::spawn(async move {
            while usr1.recv().await.is_some() {
                if let Err(e) = estop.set(true, "signal") {
                    status_warn!("e-stop latched by SIGUSR1, but its state could not be kept: {e}");
                }
            }
        });
    }
    #[cfg(not(unix))]
    let _ = estop;
    Ok(())
}

/// SIGHUP reads the server's certificate and key again; a bad pair is reported and the old one kept.
fn reload_on_sighup(cert: Arc<thorn_plugin::tls::ServerCert>) -> Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut hup = signal(SignalKind::hangup()).context("listening for SIGHUP")?;
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                match cert.reload() {
                    Ok(()) => status!("TLS certificate reloaded from {}", cert.paths().0.display()),
                    Err(e) => status_warn!(
                        "warning: TLS certificate not reloaded (still serving the old one): {e}"
                    ),
                }
            }
        });
    }
    #[cfg(not(unix))]
    let _ = cert;
    Ok(())
}

/// Whether `host` (the `--host` flag) only accepts local clients.
pub(crate) fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host
            .trim_matches(|c| c == '[' || c == ']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// `thorn serve`: the OpenAI-compatible server.
pub fn serve(cache: &Path, a: ServeArgs) -> Result<()> {
    // The certificate before the model loads: a bad file fails at once.
    let tls = match (&a.tls_cert, &a.tls_key) {
        (Some(cert), Some(key)) => Some(thorn_plugin::tls::ServerCert::load(cert, key)?),
        _ => None,
    };
    // Upstreams first: a malformed spec or a missing key fails before the model loads.
    let specs = a
        .upstream
        .iter()
        .map(|s| UpstreamSpec::parse(s))
        .collect::<Result<Vec<_>, _>>()?;
    let upstreams = Upstreams::new(specs, a.local_first.as_deref())?;
    a.agent.place.check()?;
    // The port and the keys before the model loads: a taken port or a bad key file fails at once.
    let addr = format!("{}:{}", a.host, a.port);
    let bound =
        std::net::TcpListener::bind(&addr).with_context(|| format!("listening on {addr}"))?;
    bound.set_nonblocking(true)?;
    let mut secrets = a.api_key;
    if let Ok(env) = std::env::var("THORN_API_KEYS") {
        secrets.extend(
            env.split(',')
                .map(str::trim)
                .filter(|k| !k.is_empty())
                .map(str::to_owned),
        );
    }
    let mut keys = Keys::from_secrets(&secrets);
    if let Some(path) = &a.api_keys {
        keys.merge(Keys::load(path)?);
    }
    if keys.is_empty() && !is_loopback(&a.host) {
        status_warn!(
            "warning: {} is not a loopback address and no API key is set: anyone who can reach it can run every installed plugin (set --api-key or --api-keys)",
            a.host
        );
    }
    let controls = a.agent.place.controls();
    let estop = Arc::clone(&controls.estop);
    let agent = build_agent(cache, &a.agent, &controls)?;
    let config = ServerConfig {
        keys,
        max_body: a.max_body,
        metrics_auth: a.metrics_auth,
        http: HttpLimits {
            max_connections: a.max_connections,
            header_timeout: Duration::from_secs(a.header_timeout.max(1)),
            body_timeout: Duration::from_secs(a.body_timeout.max(1)),
            max_inflight_body: a.max_inflight_body,
            request_timeout: (a.request_timeout > 0)
                .then(|| Duration::from_secs(a.request_timeout)),
        },
        mcp: McpHttp {
            enabled: !a.no_mcp,
            allowed_hosts: a.mcp_allowed_host.clone(),
            allowed_origins: a.mcp_allowed_origin.clone(),
            max_sessions: a.mcp_max_sessions.max(1),
            max_sessions_per_key: a.mcp_max_sessions_per_key.max(1),
            max_sessions_per_peer: a.mcp_max_sessions_per_peer.max(1),
        },
        controls: controls.clone(),
        shutdown_grace: Duration::from_secs(a.shutdown_grace),
        tls: tls.clone(),
    };
    if !a.no_mcp && !is_loopback(&a.host) && a.mcp_allowed_host.is_empty() {
        status!(
            "note: /mcp accepts only loopback Host names; add --mcp-allowed-host NAME for the name remote MCP clients use"
        );
    }
    watch_plugins(
        cache,
        &a.agent.place,
        Arc::clone(agent.live_plugins()),
        Duration::from_secs(a.plugin_poll),
        Some(grammar_check(Arc::clone(&agent.model().tokenizer))?),
        controls.clone(),
    );
    let live = Arc::clone(agent.live_plugins());
    let state = Arc::new(AppState::new(agent, config).with_upstreams(upstreams.clone()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let served = rt.block_on(async {
        latch_on_sigusr1(Arc::clone(&estop))?;
        if let Some(cert) = &tls {
            reload_on_sighup(Arc::clone(cert))?;
        }
        let listener = tokio::net::TcpListener::from_std(bound)
            .with_context(|| format!("listening on {addr}"))?;
        // An upstream that is down now is reported, not fatal: the health checks find it later.
        for (name, r) in upstreams.check_all().await {
            let u = upstreams.iter().find(|u| u.name() == name).expect("listed");
            match r {
                Ok(()) => status!(
                    "upstream {name}: {} serving {}",
                    u.spec().base,
                    u.models().join(", ")
                ),
                Err(e) => status_warn!("warning: {e} (its health checks go on)"),
            }
        }
        upstreams.spawn_health();
        status!(
            "serving the OpenAI API on {}://{} (POST /v1/chat/completions, GET /v1/models, /health, /metrics{}); ctrl-c stops",
            if tls.is_some() { "https" } else { "http" },
            listener.local_addr()?,
            if a.no_mcp { "" } else { ", MCP at /mcp" }
        );
        thorn::api::serve(listener, state).await?;
        // External MCP servers run outside the sandbox: none outlives the server.
        for server in live.current().servers() {
            server.shutdown().await;
        }
        anyhow::Ok(())
    });
    // Work the shutdown cut (a plugin call on a blocking thread) is not waited for.
    rt.shutdown_timeout(Duration::from_secs(2));
    served
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_addresses_go_without_a_warning() {
        for h in ["127.0.0.1", "localhost", "::1", "[::1]", "127.1.2.3"] {
            assert!(is_loopback(h), "{h}");
        }
        for h in ["0.0.0.0", "::", "192.168.1.5", "example.com", "10.0.0.1"] {
            assert!(!is_loopback(h), "{h}");
        }
    }
}
