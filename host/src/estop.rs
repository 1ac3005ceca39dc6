//! `thorn estop on|off|status`: the running server's e-stop latch, through its API
//! (`/v1/thorn/estop`). Releasing is a decision made here or over the API; latching can also come
//! from SIGUSR1.

use crate::admin::AdminArgs;
use anyhow::Result;
use serde_json::json;

/// What to do with the latch.
#[derive(clap::Subcommand, Debug, Clone, Copy)]
pub enum EstopCmd {
    /// Latch it: no call that can move or change anything runs until it is released.
    On,
    /// Release it.
    Off,
    /// Show it.
    Status,
}

/// Runs `cmd` against the server (an operator key, or none over loopback to a server without keys).
pub fn run(cmd: EstopCmd, a: &AdminArgs) -> Result<()> {
    let body = match cmd {
        EstopCmd::Status => None,
        EstopCmd::On | EstopCmd::Off => Some(json!({"latched": matches!(cmd, EstopCmd::On)})),
    };
    let v = a.call("/v1/thorn/estop", body)?;
    let latched = v["latched"].as_bool().unwrap_or(false);
    println!(
        "e-stop {}{}",
        if latched { "LATCHED" } else { "released" },
        v["by"]
            .as_str()
            .map_or(String::new(), |by| format!(" (by {by})"))
    );
    Ok(())
}
