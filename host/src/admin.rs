//! The admin API's client, for the commands that operate a running server (`thorn estop`, `thorn
//! approvals`): where the server is, the key to present, and one JSON request.

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// Where the server is and how to authenticate.
#[derive(clap::Args, Debug, Clone)]
pub struct AdminArgs {
    /// The server's base URL.
    #[arg(long, global = true, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// An API key with the right the command needs (none: the server must have no keys and be reached
    /// over loopback).
    #[arg(long, global = true, env = "THORN_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
}

impl AdminArgs {
    /// Sends `body` (a `GET` when `None`, else a `POST`) to `path` and returns the JSON answer; a status
    /// other than 2xx is an error with the server's message.
    pub fn call(&self, path: &str, body: Option<Value>) -> Result<Value> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            let url = format!("{}{path}", self.url.trim_end_matches('/'));
            // The process's TLS (system roots plus --tls-ca) for a server on https.
            let client = thorn_plugin::tls::http_client().build()?;
            let req = match &body {
                None => client.get(&url),
                Some(b) => client
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(b.to_string()),
            };
            let req = match &self.api_key {
                Some(k) => req.bearer_auth(k),
                None => req,
            };
            let resp = req
                .send()
                .await
                .with_context(|| format!("reaching {url}"))?;
            let status = resp.status();
            let text = resp.text().await.unwrap_or_default();
            if !status.is_success() {
                let msg = serde_json::from_str::<Value>(&text)
                    .ok()
                    .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
                    .unwrap_or(text);
                bail!("{url}: {status}: {msg}");
            }
            serde_json::from_str(&text).context("the server's answer")
        })
    }
}
