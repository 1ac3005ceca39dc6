//! `thorn plugins grant`, `revoke` and `remove`: what a plugin may use, given and taken back, and the
//! plugin itself taken away. A removal or revocation is written to the policy's audit log before it is
//! made, as a call is, and a running server follows every change at its next look at the plugin directory
//! and policy (`--plugin-poll`): a removed plugin is dropped, a plugin whose grants shrank is loaded again
//! under them (or refused, when it needs what was revoked).

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::path::Path;
use thorn_plugin::{AuditLog, Policy, Record};

#[derive(clap::Args)]
/// `thorn plugins grant`: what to give a plugin.
pub struct GrantArgs {
    /// The plugin's name.
    plugin: String,
    /// A read-only directory: GUEST=HOST, e.g. /data=./docs (repeatable).
    #[arg(long, value_name = "GUEST=HOST")]
    dir: Vec<String>,
    /// A read-write directory: GUEST=HOST (repeatable).
    #[arg(long, value_name = "GUEST=HOST")]
    dir_rw: Vec<String>,
    /// An environment variable: NAME=VALUE (repeatable).
    #[arg(long, value_name = "NAME=VALUE")]
    env: Vec<String>,
    /// An environment variable copied from the host's environment (repeatable).
    #[arg(long, value_name = "NAME")]
    env_from_host: Vec<String>,
    /// Outbound TCP to HOST:PORT (port may be *) (repeatable).
    #[arg(long, value_name = "HOST:PORT")]
    net: Vec<String>,
    /// Per-call time limit.
    #[arg(long)]
    timeout_ms: Option<u64>,
    /// Linear-memory cap.
    #[arg(long)]
    memory_mib: Option<u64>,
    /// Fuel budget per call.
    #[arg(long)]
    fuel: Option<u64>,
    /// Calls that may run at once.
    #[arg(long)]
    max_concurrent: Option<u32>,
    /// Record call arguments in the audit log (not only their digest).
    #[arg(long)]
    audit_arguments: bool,
    /// Which calls wait for a person's approval: never, destructive (every function not marked
    /// read-only or non-destructive) or always; a stop function never waits.
    #[arg(long, value_parser = ["never", "destructive", "always"])]
    approval: Option<String>,
    /// How long a held call waits for its decision before it is denied.
    #[arg(long)]
    approval_timeout_ms: Option<u64>,
}

/// `thorn plugins remove`.
#[derive(clap::Args)]
pub struct RemoveArgs {
    /// The installed plugin's name.
    pub plugin: String,
    /// Keep its policy entry (its pin and grants): installed again with the same bytes, it loads
    /// without a new approval.
    #[arg(long)]
    pub keep_policy: bool,
}

/// `thorn plugins revoke`: what to take back from a plugin's grants.
#[derive(clap::Args)]
pub struct RevokeArgs {
    /// The plugin's name.
    pub plugin: String,
    /// A granted directory, by its guest path (repeatable).
    #[arg(long, value_name = "GUEST")]
    pub dir: Vec<String>,
    /// An environment variable it was given, by name, from --env or --env-from-host (repeatable).
    #[arg(long, value_name = "NAME")]
    pub env: Vec<String>,
    /// A network destination it was granted (repeatable).
    #[arg(long, alias = "tcp", value_name = "HOST:PORT")]
    pub net: Vec<String>,
    /// Every directory, variable and destination (its limits and pin stay).
    #[arg(long)]
    pub all: bool,
}

/// Writes the audit line of an operator's change to `plugin`, before the change (no line, no change).
fn audit(policy: &Policy, plugin: &str, action: &str, what: &Value) -> Result<()> {
    let Some(path) = policy.audit_path() else {
        return Ok(());
    };
    let log = AuditLog::open_with(&path, policy.audit_rotation())?;
    let sha = policy.pinned(plugin).unwrap_or_default().to_owned();
    let args_sha = thorn_plugin::sha256_hex(what.to_string().as_bytes());
    let call = log.call_id();
    let record = Record::admin(&call, plugin, &sha, action, &args_sha, what);
    log.append(&record)
        .with_context(|| format!("auditing `plugins {action}` (nothing was changed)"))?;
    Ok(())
}

/// Removes an installed plugin: its file, and (unless kept) its policy entry.
pub fn remove(dir: &Path, policy_path: &Path, a: &RemoveArgs) -> Result<()> {
    let name = &a.plugin;
    if name.contains(['/', '\\']) || name.ends_with(".wasm") {
        bail!("remove takes an installed plugin's name, not a file: {name:?}");
    }
    let file = dir.join(format!("{name}.wasm"));
    let installed = file.is_file();
    let policy = Policy::load(policy_path)?;
    let entry = policy.pinned(name).is_some();
    if !installed && (!entry || a.keep_policy) {
        bail!(
            "no plugin {name:?} installed in {} (see `thorn plugins list`)",
            dir.display()
        );
    }
    audit(
        &policy,
        name,
        "remove",
        &json!({"file": installed.then(|| file.display().to_string()), "policy_entry": !a.keep_policy && entry}),
    )?;
    if installed {
        std::fs::remove_file(&file).with_context(|| format!("removing {}", file.display()))?;
        println!("removed {}", file.display());
    }
    let record = super::provenance::path(&file);
    match std::fs::remove_file(&record) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("removing {}", record.display()));
        }
        _ => {}
    }
    if !a.keep_policy && Policy::remove(policy_path, name)? {
        println!(
            "removed {name}'s entry (pin and grants) from {}",
            policy_path.display()
        );
    }
    Ok(())
}

/// Takes grants back from a plugin's policy entry.
pub fn revoke(policy_path: &Path, a: &RevokeArgs) -> Result<()> {
    let name = &a.plugin;
    let policy = Policy::load(policy_path)?;
    if policy.pinned(name).is_none() {
        bail!(
            "the policy {} has no entry for {name:?}",
            policy_path.display()
        );
    }
    if !a.all && a.dir.is_empty() && a.env.is_empty() && a.net.is_empty() {
        bail!("say what to revoke: --dir GUEST, --env NAME, --net HOST:PORT or --all");
    }
    // What the entry grants now, to name what is not there.
    let entry = entry_of(policy_path, name)?;
    let granted_dirs: Vec<&str> = entry["filesystem"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| d["guest"].as_str())
        .collect();
    let granted_env: Vec<&str> = entry["env"]
        .as_object()
        .into_iter()
        .flat_map(|o| o.keys().map(String::as_str))
        .chain(
            entry["env_from_host"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str),
        )
        .collect();
    let granted_net: Vec<&str> = entry["network"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    for (asked, granted, what) in [
        (&a.dir, &granted_dirs, "directory"),
        (&a.env, &granted_env, "variable"),
        (&a.net, &granted_net, "destination"),
    ] {
        if let Some(x) = asked.iter().find(|x| !granted.contains(&x.as_str())) {
            bail!("{name} was not granted the {what} {x:?} (granted: {granted:?})");
        }
    }
    let what = if a.all {
        json!({"all": true})
    } else {
        json!({"dirs": a.dir, "env": a.env, "net": a.net})
    };
    audit(&policy, name, "revoke", &what)?;
    Policy::edit(policy_path, name, |entry| {
        if a.all {
            for k in ["filesystem", "env", "env_from_host", "network"] {
                entry.remove(k);
            }
            return;
        }
        if let Some(fs) = entry.get_mut("filesystem").and_then(Value::as_array_mut) {
            fs.retain(|d| {
                !d["guest"]
                    .as_str()
                    .is_some_and(|g| a.dir.iter().any(|x| x == g))
            });
        }
        if let Some(env) = entry.get_mut("env").and_then(Value::as_object_mut) {
            env.retain(|k, _| !a.env.contains(k));
        }
        for (key, gone) in [("env_from_host", &a.env), ("network", &a.net)] {
            if let Some(l) = entry.get_mut(key).and_then(Value::as_array_mut) {
                l.retain(|v| !v.as_str().is_some_and(|s| gone.iter().any(|x| x == s)));
            }
        }
    })?;
    println!("updated {} for {name}", policy_path.display());
    Ok(())
}

/// The policy file's entry for `name`, as written.
fn entry_of(policy_path: &Path, name: &str) -> Result<Value> {
    let text = std::fs::read_to_string(policy_path)
        .with_context(|| format!("reading {}", policy_path.display()))?;
    let doc: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not JSON", policy_path.display()))?;
    Ok(doc["plugins"][name].clone())
}

fn split_pair<'a>(s: &'a str, what: &str) -> Result<(&'a str, &'a str)> {
    s.split_once('=')
        .filter(|(a, b)| !a.is_empty() && !b.is_empty())
        .with_context(|| format!("{what} must be written as A=B, got {s:?}"))
}

/// Adds grants to a plugin's policy entry.
pub fn grant(policy_path: &Path, g: GrantArgs) -> Result<()> {
    let mut dirs = Vec::new();
    for (list, access) in [(&g.dir, "read"), (&g.dir_rw, "read-write")] {
        for d in list {
            let (guest, host) = split_pair(d, "--dir")?;
            let host = std::path::absolute(host)
                .with_context(|| format!("resolving {host}"))?
                .display()
                .to_string();
            dirs.push(json!({"guest": guest, "host": host, "access": access}));
        }
    }
    let mut env = Vec::new();
    for e in &g.env {
        let (k, v) = split_pair(e, "--env")?;
        env.push((k.to_owned(), v.to_owned()));
    }
    let limits: Vec<(&str, Option<u64>)> = vec![
        ("timeout_ms", g.timeout_ms),
        ("memory_mib", g.memory_mib),
        ("fuel", g.fuel),
        ("max_concurrent", g.max_concurrent.map(u64::from)),
    ];
    Policy::edit(policy_path, &g.plugin, |entry| {
        fn list<'a>(entry: &'a mut serde_json::Map<String, Value>, k: &str) -> &'a mut Vec<Value> {
            let v = entry.entry(k).or_insert_with(|| json!([]));
            if !v.is_array() {
                *v = json!([]);
            }
            v.as_array_mut().expect("just made an array")
        }
        for d in dirs {
            let fs = list(entry, "filesystem");
            fs.retain(|x| x["guest"] != d["guest"]);
            fs.push(d);
        }
        if !env.is_empty() {
            let e = entry.entry("env").or_insert_with(|| json!({}));
            if let Some(o) = e.as_object_mut() {
                for (k, v) in env {
                    o.insert(k, Value::String(v));
                }
            }
        }
        for k in g.env_from_host {
            let l = list(entry, "env_from_host");
            if !l.contains(&json!(k)) {
                l.push(json!(k));
            }
        }
        for n in g.net {
            let l = list(entry, "network");
            if !l.contains(&json!(n)) {
                l.push(json!(n));
            }
        }
        for (k, v) in limits {
            if let Some(v) = v {
                let l = entry.entry("limits").or_insert_with(|| json!({}));
                if let Some(o) = l.as_object_mut() {
                    o.insert(k.into(), json!(v));
                }
            }
        }
        if g.audit_arguments {
            entry.insert("audit_arguments".into(), Value::Bool(true));
        }
        if let Some(a) = &g.approval {
            entry.insert("approval".into(), json!(a));
        }
        if let Some(t) = g.approval_timeout_ms {
            entry.insert("approval_timeout_ms".into(), json!(t));
        }
    })?;
    println!("updated {} for {}", policy_path.display(), g.plugin);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(plugin: &str) -> GrantArgs {
        GrantArgs {
            plugin: plugin.into(),
            dir: Vec::new(),
            dir_rw: Vec::new(),
            env: Vec::new(),
            env_from_host: Vec::new(),
            net: Vec::new(),
            timeout_ms: None,
            memory_mib: None,
            fuel: None,
            max_concurrent: None,
            audit_arguments: false,
            approval: None,
            approval_timeout_ms: None,
        }
    }

    #[test]
    fn grant_edits_the_policy_and_keeps_it_valid() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.json");
        let docs = dir.path().join("docs");
        grant(
            &path,
            GrantArgs {
                dir: vec![format!("/data={}", docs.display())],
                env: vec!["A=1".into()],
                net: vec!["example.com:443".into()],
                timeout_ms: Some(250),
                ..args("files")
            },
        )
        .unwrap();
        // Granting again replaces the mount of the same guest path and adds, never duplicates.
        grant(
            &path,
            GrantArgs {
                dir_rw: vec![format!("/data={}", docs.display())],
                net: vec!["example.com:443".into()],
                audit_arguments: true,
                approval: Some("destructive".into()),
                approval_timeout_ms: Some(30_000),
                ..args("files")
            },
        )
        .unwrap();
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let e = &doc["plugins"]["files"];
        assert_eq!(e["sha256"], "0".repeat(64), "granted, not yet approved");
        assert_eq!(
            e["filesystem"],
            json!([{"guest": "/data", "host": docs.display().to_string(), "access": "read-write"}])
        );
        assert_eq!(e["env"], json!({"A": "1"}));
        assert_eq!(e["network"], json!(["example.com:443"]));
        assert_eq!(e["limits"], json!({"timeout_ms": 250}));
        assert_eq!(e["audit_arguments"], true);
        assert_eq!(
            (e["approval"].as_str(), e["approval_timeout_ms"].as_u64()),
            (Some("destructive"), Some(30_000))
        );
        // A bad value is refused and the file is left as it was.
        let before = std::fs::read_to_string(&path).unwrap();
        assert!(
            grant(
                &path,
                GrantArgs {
                    net: vec!["no-port".into()],
                    ..args("files")
                }
            )
            .is_err()
        );
        assert!(
            grant(
                &path,
                GrantArgs {
                    env: vec!["novalue".into()],
                    ..args("files")
                }
            )
            .is_err()
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), before);
    }
}
