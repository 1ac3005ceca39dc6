//! `thorn estop on|off|status`: the running server's e-stop latch, through its API
//! (`/v1/thorn/estop`). Releasing is a decision made here or over the API; latching can also come
//! from SIGUSR1.

use anyhow::{Context, Result, bail};

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

/// Where the server is and how to authenticate.
#[derive(clap::Args, Debug, Clone)]
pub struct EstopArgs {
    /// The server's base URL.
    #[arg(long, global = true, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// An operator API key (none: the server must have no keys and be reached over loopback).
    #[arg(long, global = true, env = "THORN_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
}

/// Runs `cmd` against the server.
pub fn run(cmd: EstopCmd, a: &EstopArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let url = format!("{}/v1/thorn/estop", a.url.trim_end_matches('/'));
        let client = reqwest::Client::new();
        let req = match cmd {
            EstopCmd::Status => client.get(&url),
            EstopCmd::On | EstopCmd::Off => client
                .post(&url)
                .header("content-type", "application/json")
                .body(format!("{{\"latched\":{}}}", matches!(cmd, EstopCmd::On))),
        };
        let req = match &a.api_key {
            Some(k) => req.bearer_auth(k),
            None => req,
        };
        let resp = req
            .send()
            .await
            .with_context(|| format!("reaching {url}"))?;
        let status = resp.status();
        let body = resp.text().await.unwrap_or_default();
        if !status.is_success() {
            bail!("{url}: {status}: {body}");
        }
        let v: serde_json::Value = serde_json::from_str(&body).context("the server's answer")?;
        let latched = v["latched"].as_bool().unwrap_or(false);
        println!(
            "e-stop {}{}",
            if latched { "LATCHED" } else { "released" },
            v["by"]
                .as_str()
                .map_or(String::new(), |by| format!(" (by {by})"))
        );
        Ok(())
    })
}
