//! `thorn plugins remove` and `thorn plugins revoke`: taking a plugin, or some of what it was granted,
//! away. Each change is written to the policy's audit log before it is made, as a call is, and a running
//! server follows it at its next look at the plugin directory and policy (`--plugin-poll`): a removed
//! plugin is dropped, a plugin whose grants shrank is loaded again under them (or refused, when it needs
//! what was revoked).

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::path::Path;
use thorn_plugin::{AuditLog, Policy, Record};

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
fn audit(policy_path: &Path, plugin: &str, action: &str, what: &Value) -> Result<()> {
    let policy = Policy::load(policy_path)?;
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
    let entry = Policy::load(policy_path)
        .ok()
        .and_then(|p| p.pinned(name).map(str::to_owned));
    if !installed && (entry.is_none() || a.keep_policy) {
        bail!(
            "no plugin {name:?} installed in {} (see `thorn plugins list`)",
            dir.display()
        );
    }
    audit(
        policy_path,
        name,
        "remove",
        &json!({"file": installed.then(|| file.display().to_string()), "policy_entry": !a.keep_policy && entry.is_some()}),
    )?;
    if installed {
        std::fs::remove_file(&file).with_context(|| format!("removing {}", file.display()))?;
        println!("removed {}", file.display());
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
    audit(policy_path, name, "revoke", &what)?;
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
