//! Human approval of tool calls: the operator's policy says which calls wait for a person
//! (`approval: never | destructive | always`, per plugin or per function), and a call that must wait is
//! held here, pending, until someone allowed to decide approves or denies it, its time runs out (denied),
//! the e-stop latches (refused as `estopped`) or its request goes away (denied).
//!
//! The decision comes over a channel the model cannot drive: the admin API (`/v1/thorn/approvals`, keys
//! with the `approve` right), the CLI (`thorn approvals`, through that API) or an MCP client's
//! elicitation. A request's own API key cannot approve its own calls unless the policy says so
//! (`approve_own`). A waiting call holds no engine slot and no plugin slot: it waits on its own task
//! while every other request keeps decoding. Every step is in the audit log: the pending call, the
//! decision with who made it, then the call as usual.
//!
//! Which calls wait under `destructive`: those not marked read-only and not marked
//! `destructiveHint: false` (MCP's default for a tool that is not read-only is destructive, so a
//! function with no hints waits). A function the manifest marks `"stop": true` never waits, whatever
//! the policy says: nothing may hold back what makes an actuator safe.

use crate::manifest::FunctionDef;
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use tokio::sync::{mpsc, oneshot};

/// Which calls of a plugin (or function) wait for a person.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Mode {
    /// None.
    #[default]
    Never,
    /// Those that may change something (see the module docs).
    Destructive,
    /// Every call (but a stop's).
    Always,
}

impl Mode {
    /// Parses the policy's word.
    pub fn parse(s: &str) -> Option<Mode> {
        match s {
            "never" => Some(Mode::Never),
            "destructive" => Some(Mode::Destructive),
            "always" => Some(Mode::Always),
            _ => None,
        }
    }
}

/// The default time a call waits for its decision.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// One plugin's (or function's) approval rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApprovalRule {
    /// Which calls wait.
    pub mode: Mode,
    /// How long a call waits before it is denied.
    pub timeout: Duration,
    /// Whether the key that made a request may approve that request's calls.
    pub approve_own: bool,
}

impl Default for ApprovalRule {
    fn default() -> Self {
        ApprovalRule {
            mode: Mode::Never,
            timeout: DEFAULT_TIMEOUT,
            approve_own: false,
        }
    }
}

impl ApprovalRule {
    /// Whether a call of `f` waits for a decision under this rule.
    pub fn applies_to(&self, f: &FunctionDef) -> bool {
        if f.stop {
            return false;
        }
        match self.mode {
            Mode::Never => false,
            Mode::Always => true,
            Mode::Destructive => {
                f.annotations.read_only != Some(true) && f.annotations.destructive != Some(false)
            }
        }
    }
}

/// A plugin's approval rules: its own, and each function's that has one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApprovalRules {
    /// The plugin's rule.
    pub plugin: ApprovalRule,
    /// Function name -> its rule (over the plugin's).
    pub functions: BTreeMap<String, ApprovalRule>,
}

impl ApprovalRules {
    /// The rule for `function`.
    pub fn rule(&self, function: &str) -> &ApprovalRule {
        self.functions.get(function).unwrap_or(&self.plugin)
    }
}

/// A call waiting for its decision, as the approvals API lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Pending {
    /// The approval's id (`apv_...`): what a decision names.
    pub id: String,
    /// The plugin (or MCP server).
    pub plugin: String,
    /// The function.
    pub function: String,
    /// The arguments it would run with.
    pub arguments: Value,
    /// The API key of the request that made it, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_id: Option<String>,
    /// Its conversation, if known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conversation: Option<String>,
    /// The request it belongs to, if known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request: Option<String>,
    /// Seconds since the Unix epoch when it began waiting.
    pub created_at: u64,
    /// Seconds since the Unix epoch when it is denied if nobody decides.
    pub expires_at: u64,
}

/// How a wait ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Someone approved it.
    Approved {
        /// Who (an API key id, `loopback`, `mcp-elicitation`, ...).
        by: String,
    },
    /// Someone denied it, or nobody decided in time (`by` is `timeout`), or its request went away
    /// (`cancelled`).
    Denied {
        /// Who.
        by: String,
        /// Why, if said.
        reason: Option<String>,
    },
    /// The e-stop latched while it waited.
    Estopped,
}

/// Who decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Approver {
    /// The name the audit log records (a key id, `loopback`, `cli`, ...).
    pub name: String,
    /// The API key deciding, if any (a request's own key may not approve its calls unless allowed).
    pub key_id: Option<String>,
}

/// Why a decision was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecideError {
    /// No call waits under this id (decided already, timed out, or never was).
    #[error("no call is waiting for approval as {0:?} (decided already, timed out, or unknown)")]
    Unknown(String),
    /// The decider's key made the request the call belongs to.
    #[error(
        "key {key:?} made the request this call belongs to and may not approve it (the policy's \"approve_own\" allows that)"
    )]
    OwnCall {
        /// The key.
        key: String,
    },
}

struct Entry {
    info: Pending,
    approve_own: bool,
    decide: Option<oneshot::Sender<Verdict>>,
}

#[derive(Default)]
struct Inner {
    pending: BTreeMap<String, Entry>,
    watchers: HashMap<String, Vec<mpsc::UnboundedSender<Pending>>>,
}

/// The calls waiting for a decision, process-wide (one per [`crate::PluginHost`], shared by every plugin
/// and server it runs, like the e-stop).
#[derive(Default)]
pub struct Approvals {
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for Approvals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Approvals")
            .field("pending", &self.lock().pending.len())
            .finish()
    }
}

impl Approvals {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The calls waiting now, oldest first.
    pub fn list(&self) -> Vec<Pending> {
        let mut v: Vec<Pending> = self
            .lock()
            .pending
            .values()
            .map(|e| e.info.clone())
            .collect();
        v.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        v
    }

    /// The call waiting as `id`, if any.
    pub fn get(&self, id: &str) -> Option<Pending> {
        self.lock().pending.get(id).map(|e| e.info.clone())
    }

    /// Decides the call waiting as `id`: approves it (`approve`) or denies it, for `by`.
    pub fn decide(
        &self,
        id: &str,
        approve: bool,
        by: &Approver,
        reason: Option<String>,
    ) -> Result<Pending, DecideError> {
        let mut inner = self.lock();
        let entry = inner
            .pending
            .get_mut(id)
            .ok_or_else(|| DecideError::Unknown(id.to_owned()))?;
        if approve
            && !entry.approve_own
            && let (Some(mine), Some(theirs)) = (&by.key_id, &entry.info.key_id)
            && mine == theirs
        {
            return Err(DecideError::OwnCall { key: mine.clone() });
        }
        let verdict = if approve {
            Verdict::Approved {
                by: by.name.clone(),
            }
        } else {
            Verdict::Denied {
                by: by.name.clone(),
                reason,
            }
        };
        let info = entry.info.clone();
        let sent = entry
            .decide
            .take()
            .is_some_and(|tx| tx.send(verdict).is_ok());
        if !sent {
            return Err(DecideError::Unknown(id.to_owned()));
        }
        inner.pending.remove(id);
        Ok(info)
    }

    /// Whether `key` may approve the call waiting as `id` (it is not the request's own key, or the
    /// policy allows that); false when nothing waits as `id`.
    pub fn may_approve(&self, id: &str, key: Option<&str>) -> bool {
        self.lock()
            .pending
            .get(id)
            .is_some_and(|e| e.approve_own || key.is_none() || e.info.key_id.as_deref() != key)
    }

    /// Whether a call of `request` waits for its decision.
    pub fn waiting_for(&self, request: &str) -> bool {
        self.lock()
            .pending
            .values()
            .any(|e| e.info.request.as_deref() == Some(request))
    }

    /// Denies every call of `request` still waiting (its client went away).
    pub fn withdraw(&self, request: &str) {
        let mut inner = self.lock();
        let ids: Vec<String> = inner
            .pending
            .iter()
            .filter(|(_, e)| e.info.request.as_deref() == Some(request))
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            if let Some(mut e) = inner.pending.remove(&id)
                && let Some(tx) = e.decide.take()
            {
                let _ = tx.send(Verdict::Denied {
                    by: "cancelled".into(),
                    reason: Some("the request was cancelled".into()),
                });
            }
        }
    }

    /// Reports each call of `request` that begins waiting, as it begins (until the [`Watch`] is dropped).
    pub fn watch(self: &Arc<Self>, request: &str) -> Watch {
        let (tx, rx) = mpsc::unbounded_channel();
        self.lock()
            .watchers
            .entry(request.to_owned())
            .or_default()
            .push(tx);
        Watch {
            rx,
            request: request.to_owned(),
            approvals: Arc::clone(self),
        }
    }

    /// Puts a call up for a decision: it is listed, and the request's watchers are told.
    pub(crate) fn open(&self, info: Pending, approve_own: bool) -> Ticket<'_> {
        let (tx, rx) = oneshot::channel();
        let id = info.id.clone();
        let mut inner = self.lock();
        if let Some(r) = &info.request
            && let Some(ws) = inner.watchers.get_mut(r)
        {
            ws.retain(|w| w.send(info.clone()).is_ok());
        }
        inner.pending.insert(
            id.clone(),
            Entry {
                info,
                approve_own,
                decide: Some(tx),
            },
        );
        Ticket {
            approvals: self,
            id,
            rx,
        }
    }
}

/// A call put up for a decision; dropping it takes the call off the list.
pub(crate) struct Ticket<'a> {
    approvals: &'a Approvals,
    id: String,
    rx: oneshot::Receiver<Verdict>,
}

impl Ticket<'_> {
    /// Waits for the decision: at most `timeout` (then denied), and no longer than the e-stop stays
    /// released.
    pub(crate) async fn wait(mut self, timeout: Duration, estop: &crate::Estop) -> Verdict {
        tokio::select! {
            v = &mut self.rx => v.unwrap_or(Verdict::Denied {
                by: "host".into(),
                reason: Some("the approvals queue went away".into()),
            }),
            () = tokio::time::sleep(timeout) => Verdict::Denied {
                by: "timeout".into(),
                reason: Some(format!("nobody approved it within {} s", timeout.as_secs_f64())),
            },
            () = estop.until_latched() => Verdict::Estopped,
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.approvals.lock().pending.remove(&self.id);
    }
}

/// The calls of one request that begin waiting for approval (see [`Approvals::watch`]).
pub struct Watch {
    rx: mpsc::UnboundedReceiver<Pending>,
    request: String,
    approvals: Arc<Approvals>,
}

impl Watch {
    /// The next call that began waiting (`None`: never, the queue is gone).
    pub async fn next(&mut self) -> Option<Pending> {
        self.rx.recv().await
    }

    /// Withdraws the request's waiting calls (denied as cancelled).
    pub fn withdraw(&self) {
        self.approvals.withdraw(&self.request);
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.rx.close();
        let mut inner = self.approvals.lock();
        if let Some(ws) = inner.watchers.get_mut(&self.request) {
            ws.retain(|w| !w.is_closed());
            if ws.is_empty() {
                inner.watchers.remove(&self.request);
            }
        }
    }
}

/// A fresh approval id (`apv_` and random characters).
pub(crate) fn new_id() -> String {
    thorn_tools::call_id().replacen("call_", "apv_", 1)
}

/// Seconds since the Unix epoch, `after` from now.
pub(crate) fn unix_secs(after: Duration) -> u64 {
    (SystemTime::now() + after)
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::Annotations;
    use serde_json::json;

    fn function(stop: bool, read_only: Option<bool>, destructive: Option<bool>) -> FunctionDef {
        FunctionDef {
            name: "f".into(),
            description: String::new(),
            parameters: json!({"type": "object"}),
            returns: None,
            examples: Vec::new(),
            answer: None,
            from_request: Vec::new(),
            annotations: Annotations {
                read_only,
                destructive,
                ..Annotations::default()
            },
            stop,
            deadman: None,
        }
    }

    #[test]
    fn destructive_means_what_mcp_means_and_a_stop_never_waits() {
        let rule = |mode| ApprovalRule {
            mode,
            ..ApprovalRule::default()
        };
        let d = rule(Mode::Destructive);
        assert!(
            d.applies_to(&function(false, None, None)),
            "no hints: waits"
        );
        assert!(d.applies_to(&function(false, Some(false), Some(true))));
        assert!(!d.applies_to(&function(false, Some(true), None)));
        assert!(!d.applies_to(&function(false, None, Some(false))));
        assert!(!d.applies_to(&function(true, None, Some(true))), "a stop");
        assert!(rule(Mode::Always).applies_to(&function(false, Some(true), None)));
        assert!(!rule(Mode::Always).applies_to(&function(true, None, None)));
        assert!(!rule(Mode::Never).applies_to(&function(false, None, Some(true))));
    }

    fn pending(id: &str, key: Option<&str>, request: &str) -> Pending {
        Pending {
            id: id.into(),
            plugin: "arm".into(),
            function: "move".into(),
            arguments: json!({"angle": 5}),
            key_id: key.map(Into::into),
            conversation: None,
            request: Some(request.into()),
            created_at: unix_secs(Duration::ZERO),
            expires_at: unix_secs(DEFAULT_TIMEOUT),
        }
    }

    fn who(name: &str, key: Option<&str>) -> Approver {
        Approver {
            name: name.into(),
            key_id: key.map(Into::into),
        }
    }

    #[tokio::test]
    async fn a_waiting_call_is_listed_watched_and_decided_once() {
        let a = Arc::new(Approvals::default());
        let estop = crate::Estop::in_memory();
        let mut watch = a.watch("req_1");
        let t = a.open(pending("apv_1", Some("robot"), "req_1"), false);
        assert_eq!(watch.next().await.unwrap().id, "apv_1");
        assert_eq!(a.list().len(), 1);
        let own = a.decide("apv_1", true, &who("robot", Some("robot")), None);
        assert_eq!(
            own.unwrap_err(),
            DecideError::OwnCall {
                key: "robot".into()
            }
        );
        // A request's own key may still deny its call.
        a.decide("apv_1", true, &who("ops", Some("ops")), None)
            .unwrap();
        assert_eq!(
            t.wait(Duration::from_secs(5), &estop).await,
            Verdict::Approved { by: "ops".into() }
        );
        assert!(a.list().is_empty());
        assert!(matches!(
            a.decide("apv_1", false, &who("ops", None), None),
            Err(DecideError::Unknown(_))
        ));
    }

    #[tokio::test]
    async fn unanswered_calls_time_out_estop_and_cancel_deny_and_a_dropped_ticket_unlists() {
        let a = Arc::new(Approvals::default());
        let estop = crate::Estop::in_memory();
        let t = a.open(pending("apv_t", None, "r"), false);
        let v = t.wait(Duration::from_millis(20), &estop).await;
        assert!(
            matches!(v, Verdict::Denied { ref by, .. } if by == "timeout"),
            "{v:?}"
        );
        assert!(a.list().is_empty());

        let t = a.open(pending("apv_c", None, "r2"), false);
        a.withdraw("r2");
        let v = t.wait(Duration::from_secs(5), &estop).await;
        assert!(
            matches!(v, Verdict::Denied { ref by, .. } if by == "cancelled"),
            "{v:?}"
        );

        let t = a.open(pending("apv_e", None, "r3"), false);
        let (v, ()) = tokio::join!(t.wait(Duration::from_secs(5), &estop), async {
            estop.set(true, "test").unwrap();
        });
        assert_eq!(v, Verdict::Estopped);

        let t = a.open(pending("apv_d", None, "r4"), true);
        assert_eq!(a.list().len(), 1);
        drop(t);
        assert!(a.list().is_empty());
        // With approve_own, the request's key may approve.
        let t = a.open(pending("apv_o", Some("k"), "r5"), true);
        a.decide("apv_o", true, &who("k", Some("k")), None).unwrap();
        assert!(matches!(
            t.wait(Duration::from_secs(5), &crate::Estop::in_memory())
                .await,
            Verdict::Approved { .. }
        ));
    }

    #[test]
    fn a_dropped_watch_is_forgotten() {
        let a = Arc::new(Approvals::default());
        let w = a.watch("r");
        let w2 = a.watch("r");
        drop(w);
        assert_eq!(a.lock().watchers["r"].len(), 1);
        drop(w2);
        assert!(a.lock().watchers.is_empty());
    }
}
