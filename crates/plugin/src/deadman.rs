//! Deadman stops for actuators. A function whose manifest declares a `deadman` is a motion that lasts as
//! long as its call runs (the robot arm's jog). The host stops it, by calling the plugin's declared stop
//! function (which always runs: no approval, rate limit or e-stop holds a stop back), whenever the motion
//! ends any way but finishing:
//!
//! - it runs longer than its `max_ms` (or the operator's shorter `deadman_ms`): the call is ended
//!   (error kind `deadman`), then stopped;
//! - the call times out, traps or fails in any other way;
//! - the e-stop latches (the call is interrupted, `estopped`);
//! - its request is cancelled or its client goes away: the agent abandons the call, and the stop runs
//!   on its own task (the call's future is gone).
//!
//! The stop call is audited like any call, made for the caller `deadman` in the original conversation,
//! so the log shows why the arm stopped.

use crate::{CallReport, Caller, Plugin, PluginError};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

/// A function's deadman, as its manifest declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deadman {
    /// The longest a motion may last.
    pub max: Duration,
    /// The stop function to call (marked `stop`, no arguments).
    pub stop: String,
}

/// One deadman call in flight: dropped before it is settled, it stops the motion on a task of its own.
struct Armed {
    plugin: Arc<Plugin>,
    stop: String,
    caller: Caller,
    settled: bool,
}

impl Armed {
    /// Calls the stop now, for `why`, and waits for it.
    async fn stop_now(mut self, why: &str) {
        self.settled = true;
        stop(&self.plugin, &self.stop, &self.caller, why).await;
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let (plugin, name, caller) = (
            Arc::clone(&self.plugin),
            self.stop.clone(),
            self.caller.clone(),
        );
        let handle = plugin.handle.clone();
        handle.spawn(async move {
            stop(
                &plugin,
                &name,
                &caller,
                "the call was abandoned (its request went away)",
            )
            .await;
        });
    }
}

async fn stop(plugin: &Plugin, name: &str, caller: &Caller, why: &str) {
    tracing::warn!(
        plugin = plugin.name(),
        stop = name,
        why,
        "deadman: stopping the motion"
    );
    let (out, _) = plugin.call_async(caller, name, &json!({})).await;
    if let Err(e) = out {
        tracing::error!(plugin = plugin.name(), stop = name, error = %e, "deadman: the stop failed");
    }
}

/// Calls `function` of `plugin` (its manifest declares `dm`) for `caller`, stopping the motion unless it
/// finished (see the module docs).
pub(crate) async fn call(
    plugin: &Arc<Plugin>,
    dm: &Deadman,
    caller: &Caller,
    function: &str,
    args: &Value,
) -> (Result<Value, PluginError>, CallReport) {
    let armed = Armed {
        plugin: Arc::clone(plugin),
        stop: dm.stop.clone(),
        caller: Caller {
            conversation: caller.conversation.clone(),
            key_id: None,
            peer: Some("deadman".into()),
            request: None,
        },
        settled: false,
    };
    let out = plugin.call_async(caller, function, args).await;
    match &out.0 {
        Ok(_) => {
            let mut armed = armed;
            armed.settled = true;
        }
        // Refused before it ran: nothing moved.
        Err(
            PluginError::Arguments(_)
            | PluginError::UnknownFunction { .. }
            | PluginError::RateLimited { .. }
            | PluginError::Denied { .. }
            | PluginError::Caller(_),
        ) => {
            let mut armed = armed;
            armed.settled = true;
        }
        Err(e) => armed.stop_now(e.kind()).await,
    }
    out
}
