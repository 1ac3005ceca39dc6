//! `thorn approvals list|approve ID|deny ID [--reason TEXT]`: the calls a running server holds for a
//! person's approval, through its API (`/v1/thorn/approvals`), with a key that has the `approve` right
//! (or none, over loopback, to a server without keys).

use crate::admin::AdminArgs;
use anyhow::Result;
use serde_json::{Value, json};

/// What to do.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum ApprovalsCmd {
    /// The calls waiting, oldest first: id, function, arguments, who asked, when it is denied.
    List {
        /// Print the server's JSON as it is.
        #[arg(long)]
        json: bool,
    },
    /// Approve a waiting call: it runs.
    Approve {
        /// The approval's id (`apv_...`).
        id: String,
    },
    /// Deny a waiting call: the model is told it was denied (and why, when given).
    Deny {
        /// The approval's id (`apv_...`).
        id: String,
        /// Why (told to the model and recorded in the audit log).
        #[arg(long)]
        reason: Option<String>,
    },
}

/// Runs `cmd` against the server.
pub fn run(cmd: ApprovalsCmd, a: &AdminArgs) -> Result<()> {
    match cmd {
        ApprovalsCmd::List { json } => {
            let v = a.call("/v1/thorn/approvals", None)?;
            if json {
                println!("{v}");
                return Ok(());
            }
            let calls = v["data"].as_array().cloned().unwrap_or_default();
            if calls.is_empty() {
                println!("no call is waiting for approval");
            }
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            for c in calls {
                let left = c["expires_at"].as_u64().unwrap_or(0).saturating_sub(now);
                println!(
                    "{}  {}.{}({})  key {}  denied in {left} s",
                    text(&c["id"]),
                    text(&c["plugin"]),
                    text(&c["function"]),
                    c["arguments"],
                    c["key_id"].as_str().unwrap_or("(none)"),
                );
            }
        }
        ApprovalsCmd::Approve { id } => decide(a, &id, json!({"decision": "approve"}))?,
        ApprovalsCmd::Deny { id, reason } => {
            decide(a, &id, json!({"decision": "deny", "reason": reason}))?;
        }
    }
    Ok(())
}

fn decide(a: &AdminArgs, id: &str, body: Value) -> Result<()> {
    let v = a.call(&format!("/v1/thorn/approvals/{id}"), Some(body))?;
    println!(
        "{} {}: {}({}) (by {})",
        if v["decision"] == "approve" {
            "approved"
        } else {
            "denied"
        },
        text(&v["id"]),
        text(&v["call"]["function"]),
        v["call"]["arguments"],
        text(&v["by"]),
    );
    Ok(())
}

fn text(v: &Value) -> &str {
    v.as_str().unwrap_or("?")
}
