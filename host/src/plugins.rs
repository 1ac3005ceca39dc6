//! `thorn plugins ...`: write and build, install, approve, grant, inspect, check, call, revoke and remove
//! tool plugins.
//!
//! A plugin argument is an installed plugin's name, or a file when it is written as a path (it contains a
//! `/` or ends in `.wasm`): a bare name never picks up a file of that name in the current directory.

use anyhow::{Context, Result, bail};
use base64::Engine;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thorn_plugin::signing::{Trust, keyed};
use thorn_plugin::{
    AuditLog, Caller, Candidate, HostConfig, PluginError, PluginHost, Policy, Requests, components,
};

pub use crate::place::Place;

mod author;
mod manage;
mod oci;
mod provenance;

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// The installed plugins and whether the policy admits each.
    List,
    /// A plugin's manifest, what it asks for and what the policy says.
    Inspect {
        /// An installed plugin's name, or a file written as a path (with a / or ending in .wasm).
        plugin: String,
        /// Print the manifest as JSON only.
        #[arg(long)]
        json: bool,
    },
    /// How the agent's tool router scores every installed function for each message (the functions it
    /// would offer are marked; none marked: it answers without tools). For plugin authors tuning
    /// descriptions and examples.
    Route {
        /// Messages, as a user would write them.
        #[arg(required = true)]
        messages: Vec<String>,
        /// Functions to show per message.
        #[arg(long, default_value_t = 4)]
        top: usize,
        /// Only these tools, as a request's `thorn:` tools name them (a plugin: its functions; or one
        /// function; the `thorn:` prefix optional), comma-separated: what that request would route.
        #[arg(long, value_delimiter = ',')]
        tools: Vec<String>,
    },
    /// Loads plugins under the policy and instantiates each once; exits non-zero if any is refused.
    Check {
        /// Installed plugin names, or files written as paths (with a / or ending in .wasm) (default: every
        /// installed plugin).
        plugins: Vec<String>,
    },
    /// Calls one function (validated, sandboxed and audited, as the server would).
    Call {
        /// An installed plugin's name, or a file written as a path (with a / or ending in .wasm).
        plugin: String,
        /// The function.
        function: String,
        /// Its arguments as a JSON object.
        #[arg(default_value = "{}")]
        args: String,
        /// Conversation id recorded in the audit log (at most 128 bytes of A-Z a-z 0-9 . _ : -).
        #[arg(long)]
        conversation: Option<String>,
        /// Also print the call's time (and fuel, when metered) on stderr.
        #[arg(long)]
        timing: bool,
    },
    /// Copies a component into the plugin directory (as <name>.wasm) and, with --approve, pins it. The file
    /// is read once: the bytes hashed and approved are the bytes installed.
    Install {
        /// The .wasm file.
        file: PathBuf,
        /// Also approve this exact file in the policy.
        #[arg(long)]
        approve: bool,
    },
    /// Pushes a component to an OCI registry as a Wasm artifact (one `application/wasm` layer); prints the
    /// reference by digest last.
    Push {
        /// The .wasm component.
        file: PathBuf,
        /// Where: oci://HOST/REPO:TAG (loopback registries over HTTP, others HTTPS).
        reference: String,
    },
    /// Signs the artifact a reference names (cosign's keyed format: ECDSA P-256 over the manifest
    /// digest, stored at the tag sha256-<hex>.sig).
    Sign {
        /// oci://HOST/REPO:TAG or oci://HOST/REPO@sha256:DIGEST.
        reference: String,
        /// The private key: P-256 in PEM, SEC1 or PKCS#8 (`openssl ecparam -name prime256v1 -genkey`).
        #[arg(long)]
        key: PathBuf,
    },
    /// Attaches a sigstore bundle (a keyless signature of the manifest, as `cosign sign` or
    /// `cosign sign-blob --bundle` over the manifest writes it) to the artifact a reference names, as an
    /// OCI referrer (cosign 3's layout).
    Attach {
        /// oci://HOST/REPO:TAG or oci://HOST/REPO@sha256:DIGEST.
        reference: String,
        /// The bundle (JSON, application/vnd.dev.sigstore.bundle.v0.3+json).
        #[arg(long)]
        bundle: PathBuf,
    },
    /// Pulls a component from an OCI registry (every digest checked; its signature verified when the
    /// policy's trust names keys or keyless identities) and installs it, with a record of where it came
    /// from that `approve` checks again.
    Pull {
        /// oci://HOST/REPO:TAG or oci://HOST/REPO@sha256:DIGEST.
        reference: String,
        /// Also approve the pulled component in the policy.
        #[arg(long)]
        approve: bool,
    },
    /// Pins a plugin's current file in the policy (first approval, or re-approval after it changed).
    Approve {
        /// An installed plugin's name, or a file written as a path (with a / or ending in .wasm).
        plugin: String,
    },
    /// Grants capabilities and sets limits for a plugin in the policy.
    Grant(manage::GrantArgs),
    /// Writes a new plugin crate (its own Cargo.toml, the SDK as a dependency, one function with a
    /// schema, an example, an answer template and a unit test) in DIR/NAME.
    New(author::NewArgs),
    /// Builds a plugin crate into a component for wasm32-wasip2; prints the component's path last.
    Build(author::BuildArgs),
    /// Removes an installed plugin: its file and its policy entry (audited; a running server drops it).
    Remove(manage::RemoveArgs),
    /// Takes grants back from a plugin (audited; a running server reloads it under what is left).
    Revoke(manage::RevokeArgs),
}

fn host(cache: &Path) -> Result<PluginHost> {
    Ok(PluginHost::with_config(HostConfig {
        cache_dir: Some(cache.join("cwasm")),
        // The CLI runs one call at a time: no need to reserve a pool.
        pool_slots: 0,
        ..HostConfig::default()
    })?)
}

/// Whether a plugin argument names a file rather than an installed plugin.
fn is_path(name: &str) -> bool {
    name.contains('/') || name.ends_with(".wasm")
}

/// `name` as a file: a path when written as one, else the installed `<dir>/<name>.wasm` (never a file of
/// that name in the current directory).
fn locate(dir: &Path, name: &str) -> Result<PathBuf> {
    if is_path(name) {
        let p = Path::new(name);
        if p.is_file() {
            return Ok(p.to_owned());
        }
        bail!("no plugin file {name:?}");
    }
    let installed = dir.join(format!("{name}.wasm"));
    if installed.is_file() {
        return Ok(installed);
    }
    bail!(
        "no plugin {name:?} installed in {} (see `thorn plugins list`; a file is written as a path, e.g. ./{name}.wasm)",
        dir.display()
    )
}

fn policy(path: &Path) -> Result<Policy> {
    Ok(Policy::load(path)?)
}

/// The policy's verdict on a candidate, in words.
fn verdict(c: &Candidate, policy: &Policy) -> std::result::Result<String, String> {
    match policy.grant(c.manifest(), c.sha256()) {
        Ok(g) => {
            let mut parts: Vec<String> = g
                .preopens
                .iter()
                .map(|p| {
                    format!(
                        "{} -> {} ({})",
                        p.guest,
                        p.host.display(),
                        if p.write { "read-write" } else { "read" }
                    )
                })
                .collect();
            parts.extend(g.env.iter().map(|(k, _)| format!("env {k}")));
            parts.extend(g.network.iter().map(|n| {
                format!(
                    "network {}:{}",
                    n.host,
                    n.port.map_or("*".into(), |p| p.to_string())
                )
            }));
            Ok(if parts.is_empty() {
                "approved, no capabilities".into()
            } else {
                format!("approved: {}", parts.join(", "))
            })
        }
        Err(e) => Err(e.to_string()),
    }
}

/// The external MCP servers the policy names, marked as running outside the sandbox.
fn print_servers(policy: &Policy) {
    for (name, s) in policy
        .mcp_server_names()
        .into_iter()
        .zip(policy.mcp_servers())
    {
        let s = match s {
            Ok(s) => s,
            Err(e) => {
                println!("{name:<12} UNSANDBOXED external MCP server, REFUSED: {e}");
                continue;
            }
        };
        let tools = s
            .tools
            .as_ref()
            .map_or_else(|| "every tool it lists".to_owned(), |t| t.join(","));
        let how = match &s.transport {
            thorn_plugin::ServerTransport::Stdio { program, args, .. } => format!(
                "runs as this user, outside the wasm sandbox: {} {}",
                program.display(),
                args.join(" ")
            ),
            thorn_plugin::ServerTransport::Http { url, bearer } => format!(
                "outside the wasm sandbox, at {url}{}",
                if bearer.is_some() {
                    " with a bearer token"
                } else {
                    ""
                }
            ),
        };
        println!(
            "{name:<12} UNSANDBOXED external MCP server ({how}); tools {tools} as {name}_<tool>; {:?} per call, {} KiB results, {} at once",
            s.timeout,
            s.max_output >> 10,
            s.max_concurrent
        );
    }
}

/// Which of `set`'s functions (by index) a request naming `tools` offers; `None`: every one.
fn offered(set: &thorn_plugin::PluginSet, tools: &[String]) -> Result<Option<Vec<bool>>> {
    if tools.is_empty() {
        return Ok(None);
    }
    let all = set.tools().tools();
    let mut among = vec![false; all.len()];
    for t in tools {
        let name = t.trim();
        let name = name
            .strip_prefix(thorn::api::HOST_TOOL_PREFIX)
            .unwrap_or(name);
        let functions: Vec<&str> = if let Some(p) = set.provider_named(name) {
            p.manifest()
                .functions
                .iter()
                .map(|f| f.name.as_str())
                .collect()
        } else if set.provider_for(name).is_some() {
            vec![name]
        } else {
            bail!("--tools: no installed plugin or plugin function is called {name:?}");
        };
        for f in functions {
            if let Some(i) = all.iter().position(|x| x.name == f) {
                among[i] = true;
            }
        }
    }
    Ok(Some(among))
}

pub fn run(cache: &Path, place: &Place, cmd: Cmd) -> Result<()> {
    if place.no_plugins {
        bail!("--no-plugins names no plugin directory for `thorn plugins` to work on");
    }
    let (dir, policy_path) = place.resolve();
    match cmd {
        Cmd::List => {
            let files = components(&dir)?;
            let policy = policy(&policy_path)?;
            print_servers(&policy);
            if files.is_empty() {
                println!(
                    "no plugins in {} (install one with `thorn plugins install FILE --approve`)",
                    dir.display()
                );
                return Ok(());
            }
            let host = host(cache)?;
            println!(
                "{:<12} {:<8} {:<14} {:<44} status",
                "plugin", "version", "sha256", "functions"
            );
            for f in files {
                match host.open(&f) {
                    Ok(c) => {
                        let m = c.manifest();
                        let fns: Vec<&str> = m.functions.iter().map(|f| f.name.as_str()).collect();
                        let status = match verdict(&c, &policy) {
                            Ok(v) => v,
                            Err(e) => format!("REFUSED: {e}"),
                        };
                        println!(
                            "{:<12} {:<8} {:<14} {:<44} {status}",
                            m.name,
                            m.version,
                            &c.sha256()[..12],
                            fns.join(",")
                        );
                    }
                    Err(e) => println!("{:<12} BROKEN: {e}", f.display()),
                }
            }
            println!("policy: {}", policy_path.display());
            Ok(())
        }
        Cmd::Inspect { plugin, json } => {
            let c = host(cache)?.open(&locate(&dir, &plugin)?)?;
            let m = c.manifest();
            let manifest = manifest_json(&c);
            if json {
                println!("{}", serde_json::to_string_pretty(&manifest)?);
                return Ok(());
            }
            println!("{} {}  sha256 {}", m.name, m.version, c.sha256());
            println!("{}\n", m.description);
            for f in &m.functions {
                println!("{}: {}", f.name, f.description);
                println!("  parameters: {}", f.parameters);
                if let Some(r) = &f.returns {
                    println!("  returns:    {r}");
                }
                for e in &f.examples {
                    println!("  example:    {:?} -> {}", e.request, e.arguments);
                }
                if !f.from_request.is_empty() {
                    println!("  from the request: {}", f.from_request.join(", "));
                }
                if let Some(a) = &f.answer {
                    println!("  answer:     {}", a.source());
                }
            }
            let req = c.requests();
            println!(
                "\nasks for: {}",
                if req.is_empty() {
                    "nothing".into()
                } else {
                    req.describe().join(", ")
                }
            );
            let policy = policy(&policy_path)?;
            match verdict(&c, &policy) {
                Ok(v) => println!("policy {}: {v}", policy_path.display()),
                Err(e) => println!("policy {}: REFUSED: {e}", policy_path.display()),
            }
            Ok(())
        }
        Cmd::Route {
            messages,
            top,
            tools,
        } => {
            let set =
                thorn_plugin::PluginSet::load_dir(&host(cache)?, &dir, &policy(&policy_path)?)?;
            let among = offered(&set, &tools)?;
            let offers = |i: usize| among.as_ref().is_none_or(|a| a[i]);
            let router = thorn::agent::router_for(&set, set.tools());
            let cfg = thorn_tools::RouteConfig::default();
            for m in &messages {
                let routed: Vec<usize> = router
                    .route_among(m, &cfg, offers)
                    .iter()
                    .map(|r| r.index)
                    .collect();
                println!("{m}");
                for r in router.rank_among(m, offers).iter().take(top) {
                    println!(
                        "  {} {:<14} score {:5.2}  coverage {:4.2}",
                        if routed.contains(&r.index) { '*' } else { ' ' },
                        set.tools().tools()[r.index].name,
                        r.score,
                        r.coverage
                    );
                }
                if routed.is_empty() {
                    println!(
                        "  (no tool: score >= {} and coverage >= {} needed)",
                        cfg.min_score, cfg.min_coverage
                    );
                }
            }
            Ok(())
        }
        Cmd::Check { plugins } => {
            let host = host(cache)?;
            let policy = policy(&policy_path)?;
            let files = if plugins.is_empty() {
                components(&dir)?
            } else {
                plugins
                    .iter()
                    .map(|p| locate(&dir, p))
                    .collect::<Result<_>>()?
            };
            if files.is_empty() {
                bail!("no plugins to check in {}", dir.display());
            }
            let mut refused = 0;
            for f in files {
                let res = host.load(&f, &policy).and_then(|p| {
                    let t = p.ping()?;
                    Ok((p, t))
                });
                match res {
                    Ok((p, t)) => {
                        let c = &p.grant().limits;
                        println!(
                            "ok       {:<12} {}  instantiates in {} us; limits: {} ms, {} MiB, {} concurrent",
                            p.name(),
                            &p.sha256()[..12],
                            t.as_micros(),
                            c.timeout.as_millis(),
                            c.memory >> 20,
                            c.max_concurrent
                        );
                    }
                    Err(e) => {
                        refused += 1;
                        println!("REFUSED  {}: {e}", f.display());
                    }
                }
            }
            if refused > 0 {
                bail!("{refused} plugin(s) refused");
            }
            Ok(())
        }
        Cmd::Call {
            plugin,
            function,
            args,
            conversation,
            timing,
        } => {
            let args: Value = serde_json::from_str(&args).context("ARGS must be a JSON object")?;
            let host = host(cache)?;
            let policy = policy(&policy_path)?;
            let mut p = host.load(&locate(&dir, &plugin)?, &policy)?;
            if let Some(a) = policy.audit_path() {
                p = p.with_audit(Arc::new(AuditLog::open_with(&a, policy.audit_rotation())?));
            }
            let caller = Caller {
                conversation,
                ..Caller::default()
            };
            caller.validate()?;
            let (out, report) = p.call_reported(&caller, &function, &args);
            for (name, text) in [("stdout", &report.stdout), ("stderr", &report.stderr)] {
                if !text.is_empty() {
                    eprintln!("--- plugin {name}:\n{}", text.trim_end());
                }
            }
            if timing {
                eprintln!(
                    "--- {} us{}",
                    report.duration.as_micros(),
                    report.fuel.map_or(String::new(), |f| format!(", {f} fuel"))
                );
            }
            match out {
                Ok(v) => {
                    println!("{}", serde_json::to_string_pretty(&v)?);
                    Ok(())
                }
                Err(e @ PluginError::Tool(_)) => bail!("the tool reported an error: {e}"),
                Err(e) => bail!("{e} [{}]", e.kind()),
            }
        }
        Cmd::Install { file, approve } => {
            // One read: the bytes hashed (and approved) are the bytes written.
            let bytes =
                std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
            let dest = install(cache, &dir, &policy_path, &file, &bytes, approve)?;
            // A local file replacing a pulled one: the record of the pull no longer describes it.
            match std::fs::remove_file(provenance::path(&dest)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
                _ => Ok(()),
            }
        }
        Cmd::Push { file, reference } => {
            let r = oci::reference(&reference)?;
            let bytes =
                std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
            let c = host(cache)?.open_bytes(&file, &bytes)?;
            let manifest = manifest_json(&c);
            let digest = oci::push(&r, bytes, &manifest)?;
            println!(
                "pushed {} {} (sha256 {}) to {r}",
                c.manifest().name,
                c.manifest().version,
                c.sha256()
            );
            println!("oci://{}/{}@{digest}", r.registry(), r.repository());
            Ok(())
        }
        Cmd::Sign { reference, key } => {
            let r = oci::reference(&reference)?;
            let pem = std::fs::read_to_string(&key)
                .with_context(|| format!("reading {}", key.display()))?;
            let key = keyed::signing_key(&pem).with_context(|| key.display().to_string())?;
            let digest = oci::sign(&r, &key)?;
            println!("signed {} (manifest {digest})", oci::repository(&r));
            Ok(())
        }
        Cmd::Attach { reference, bundle } => {
            let r = oci::reference(&reference)?;
            let json =
                std::fs::read(&bundle).with_context(|| format!("reading {}", bundle.display()))?;
            let digest = oci::attach(&r, &json)?;
            println!("attached {} to {r} (referrer {digest})", bundle.display());
            Ok(())
        }
        Cmd::Pull { reference, approve } => {
            let r = oci::reference(&reference)?;
            let trust = Trust::of(&policy(&policy_path)?)?;
            let pulled = oci::pull(&r)?;
            println!("pulled {r} (manifest {})", pulled.manifest_digest);
            let shown = format!("oci://{r}");
            let record = provenance::Provenance {
                reference: shown.clone(),
                repository: oci::repository(&r),
                manifest_digest: pulled.manifest_digest.clone(),
                manifest: base64::engine::general_purpose::STANDARD.encode(&pulled.manifest),
                // Fetched whatever the trust: the record lets a later `approve` check it. With no one
                // trusted, a registry that cannot list signatures does not stop the pull.
                evidence: match oci::evidence(&r, &pulled.manifest_digest) {
                    Ok(e) => e,
                    Err(e) if trust.is_empty() => {
                        eprintln!("warning: the signatures could not be read: {e:#}");
                        Default::default()
                    }
                    Err(e) => return Err(e),
                },
            };
            // With keys or identities in the policy, only what one of them signed is installed.
            if trust.is_empty() {
                println!("signatures not checked: the policy's trust names no keys or identities");
            } else {
                let v = record.check(&pulled.component, &trust)?;
                println!("signature verified for {}: {v}", pulled.manifest_digest);
            }
            let label = PathBuf::from(shown);
            let dest = install(
                cache,
                &dir,
                &policy_path,
                &label,
                &pulled.component,
                approve,
            )?;
            record.write(&dest)
        }
        Cmd::Approve { plugin } => {
            let file = locate(&dir, &plugin)?;
            // One read: the bytes whose signatures are checked are the bytes approved.
            let bytes =
                std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
            // A pulled plugin's signatures are checked again against the policy's trust now.
            if let Some(record) = provenance::Provenance::read(&file)? {
                let trust = Trust::of(&policy(&policy_path)?)?;
                if !trust.is_empty() {
                    let v = record.check(&bytes, &trust)?;
                    println!("signature verified for {}: {v}", record.manifest_digest);
                }
            }
            let c = host(cache)?.open_bytes(&file, &bytes)?;
            approve_and_report(&c, &policy_path)
        }
        Cmd::Grant(g) => manage::grant(&policy_path, g),
        Cmd::New(a) => author::new(&a),
        Cmd::Build(a) => author::build(&a),
        Cmd::Remove(a) => manage::remove(&dir, &policy_path, &a),
        Cmd::Revoke(a) => manage::revoke(&policy_path, &a),
    }
}

/// Installs the component `bytes` (read from `file`, a path or a registry reference) into `dir`, and
/// approves it with `approve`; the installed file.
fn install(
    cache: &Path,
    dir: &Path,
    policy_path: &Path,
    file: &Path,
    bytes: &[u8],
    approve: bool,
) -> Result<PathBuf> {
    let c = host(cache)?.open_bytes(file, bytes)?;
    let name = c.manifest().name.clone();
    let dest = dir.join(format!("{name}.wasm"));
    // Without --approve, never replace the file of an approved plugin with other bytes: the server
    // would refuse the changed file, taking the approved tool away (or run what was never
    // approved, were the pin ever moved to follow the file).
    if !approve
        && dest.exists()
        && let Some(pinned) = policy(policy_path)?.pinned(&name)
        && pinned.bytes().any(|b| b != b'0')
        && pinned != c.sha256()
    {
        bail!(
            "{name} is approved in {} (sha256 {pinned}); this file is another (sha256 {}), and installing \
             it without approval would replace the approved one. To install and approve it: `thorn \
             plugins install {} --approve`",
            policy_path.display(),
            c.sha256(),
            file.display()
        );
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
    std::io::Write::write_all(&mut tmp, bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(&dest)?;
    println!(
        "installed {name} {} as {}",
        c.manifest().version,
        dest.display()
    );
    if approve {
        approve_and_report(&c, policy_path)?;
    } else {
        println!("approve it with `thorn plugins approve {name}`");
    }
    Ok(dest)
}

/// A candidate's manifest as JSON (what `describe()` said, as thorn read it).
fn manifest_json(c: &Candidate) -> Value {
    let m = c.manifest();
    json!({
        "name": m.name, "version": m.version, "description": m.description,
        "functions": m.functions.iter().map(|f| json!({"name": f.name,
            "description": f.description, "parameters": f.parameters, "returns": f.returns,
            "examples": f.examples.iter().map(|e| json!({"request": e.request,
                "arguments": e.arguments})).collect::<Vec<_>>(),
            "from_request": f.from_request,
            "answer": f.answer.as_ref().map(thorn_tools::AnswerTemplate::source)}))
            .collect::<Vec<_>>(),
        "capabilities": m.capabilities,
    })
}

fn approve_and_report(c: &Candidate, policy_path: &Path) -> Result<()> {
    let name = &c.manifest().name;
    Policy::approve(policy_path, name, c.sha256())?;
    println!(
        "approved {name} (sha256 {}) in {}",
        c.sha256(),
        policy_path.display()
    );
    let policy = policy(policy_path)?;
    if let Err(e) = verdict(c, &policy) {
        let req: Requests = c.requests();
        println!("not loadable yet: {e}");
        println!(
            "it asks for: {}; grant with `thorn plugins grant {name} ...` (see --help)",
            req.describe().join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_name_is_only_ever_an_installed_plugin() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("calc.wasm"), b"installed").unwrap();
        assert_eq!(
            locate(dir.path(), "calc").unwrap(),
            dir.path().join("calc.wasm")
        );
        // `Cargo.toml` is a file in the current directory (the package root), but a bare name is not a path.
        assert!(Path::new("Cargo.toml").is_file());
        assert!(locate(dir.path(), "Cargo.toml").is_err());
        assert!(locate(dir.path(), "src").is_err());
        // Written as a path, a file is taken as it is.
        assert_eq!(
            locate(dir.path(), "./Cargo.toml").unwrap(),
            Path::new("./Cargo.toml")
        );
        let file = dir.path().join("calc.wasm").display().to_string();
        assert_eq!(locate(dir.path(), &file).unwrap(), Path::new(&file));
        assert!(locate(dir.path(), "missing.wasm").is_err());
        assert!(is_path("x.wasm") && is_path("a/b") && !is_path("calc"));
    }
}
