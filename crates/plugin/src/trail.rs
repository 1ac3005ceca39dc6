//! One call's audit trail: the [`Record`]s a plugin (or external MCP server) call writes, bounded and
//! redacted.
//!
//! Everything that goes into a line is bounded: the caller's ids by [`Caller::validate`] (a field that fails
//! it is left out of the record of the refused call), the function name (it may be a model's invention) to
//! [`MAX_FUNCTION_BYTES`], and the error message to [`MAX_ERROR_BYTES`]. When the policy does not record
//! arguments, they must not reach the log through an error message either: a schema violation is recorded
//! without its details (the validator quotes the offending value), and in every other message each
//! string value of the arguments (2 characters or more, raw and JSON-escaped) is replaced by `[redacted]`.

use super::approval::{ApprovalRule, Approvals, Pending, Verdict};
use super::{AuditLog, CallReport, Caller, Outcome, Phase, PluginError, Record};
use serde_json::Value;
use std::time::SystemTime;

/// The longest function name recorded, in bytes.
pub(super) const MAX_FUNCTION_BYTES: usize = 256;
/// The longest error message recorded, in bytes.
pub(super) const MAX_ERROR_BYTES: usize = 2048;
/// The most argument values redacted from one message (the longest ones).
const MAX_REDACTED: usize = 64;
const REDACTED: &str = "[redacted]";

/// Who is called, as the audit log names it: the plugin's (or server's) name, its digest, and whether
/// its calls' arguments are recorded.
#[derive(Debug, Clone, Copy)]
pub(super) struct Callee<'a> {
    pub(super) name: &'a str,
    pub(super) sha256: &'a str,
    pub(super) audit_arguments: bool,
}

/// What a call that must wait for a person's approval waits on: the process's approvals queue, its
/// rule, and the e-stop (which ends the wait).
pub(super) struct Gate<'a> {
    pub(super) approvals: &'a Approvals,
    pub(super) rule: &'a ApprovalRule,
    pub(super) estop: &'a crate::Estop,
}

/// One host call with its audit trail, the same for a plugin and an external server: the caller's ids
/// and then `admit` are checked (a refusal is one `rejected` record), a call that needs approval waits
/// for it (`gate`: a `pending` record, then a `decision` record; a denial is a `rejected` outcome), the
/// intent is made durable (or the call does not run), `run` runs on what `admit` returned and gives the result, its size and the report,
/// and the outcome is recorded before the result is handed back.
#[expect(clippy::too_many_arguments, reason = "one call's facts, spelled out")]
pub(super) async fn audited<A, F, Fut>(
    log: Option<&AuditLog>,
    callee: Callee<'_>,
    caller: &Caller,
    function: &str,
    args: &Value,
    admit: impl FnOnce() -> Result<A, PluginError>,
    gate: Option<Gate<'_>>,
    run: F,
) -> (Result<Value, PluginError>, CallReport)
where
    F: FnOnce(A) -> Fut,
    Fut: std::future::Future<Output = (Result<Value, PluginError>, usize, CallReport)>,
{
    let t0 = std::time::Instant::now();
    let trail = log.map(|log| Trail::new(log, callee, caller, function, args));
    let admitted = caller
        .validate()
        .map_err(PluginError::from)
        .and_then(|()| admit());
    // Admitted, then (when the policy holds it) approved; either refusal is one `rejected` outcome.
    let admitted = match (admitted, gate) {
        (Ok(a), Some(g)) => {
            wait_for_approval(g, trail.as_ref(), callee.name, caller, function, args)
                .await
                .map(|()| a)
        }
        (other, _) => other,
    };
    let admitted = match admitted {
        Ok(a) => a,
        Err(e) => {
            let report = CallReport {
                duration: t0.elapsed(),
                ..CallReport::default()
            };
            let out = match &trail {
                Some(t) => t.outcome(Outcome::Rejected, Err(e), 0, &report).await,
                None => Err(e),
            };
            return (out, report);
        }
    };
    if let Some(t) = &trail
        && let Err(e) = t.log.append_async(&t.record(Phase::Intent, true)).await
    {
        let report = CallReport {
            duration: t0.elapsed(),
            ..CallReport::default()
        };
        return (Err(e.into()), report); // unrecorded, so not run
    }
    // A call whose future is dropped while it runs (its request went away) still gets an outcome line.
    let abandoned = trail.as_ref().map(|t| Abandoned { trail: t, t0 });
    let (out, bytes, mut report) = run(admitted).await;
    std::mem::forget(abandoned);
    report.duration = t0.elapsed();
    let outcome = if out.is_ok() {
        Outcome::Ok
    } else {
        Outcome::Error
    };
    let out = match &trail {
        Some(t) => t.outcome(outcome, out, bytes, &report).await,
        None => out,
    };
    (out, report)
}

/// Puts the call up for approval and waits for the decision, each step in the audit log (a pending line
/// that cannot be made durable means the call is not listed and does not run). `Ok`: approved.
async fn wait_for_approval(
    g: Gate<'_>,
    trail: Option<&Trail<'_>>,
    plugin: &str,
    caller: &Caller,
    function: &str,
    args: &Value,
) -> Result<(), PluginError> {
    let id = crate::approval::new_id();
    if let Some(t) = trail {
        let line = Record {
            approval: Some(&id),
            ..t.record(Phase::Pending, true)
        };
        t.log.append_async(&line).await?;
    }
    let info = Pending {
        id: id.clone(),
        plugin: plugin.to_owned(),
        function: function.to_owned(),
        arguments: args.clone(),
        key_id: caller.key_id.clone(),
        conversation: caller.conversation.clone(),
        request: caller.request.clone(),
        created_at: crate::approval::unix_secs(std::time::Duration::ZERO),
        expires_at: crate::approval::unix_secs(g.rule.timeout),
    };
    tracing::info!(approval = %id, plugin, function, key = ?caller.key_id, "a call waits for approval");
    let verdict = g
        .approvals
        .open(info, g.rule.approve_own)
        .wait(g.rule.timeout, g.estop)
        .await;
    let (decision, by, reason) = match &verdict {
        Verdict::Approved { by } => ("approve", by.as_str(), None),
        Verdict::Denied { by, reason } => ("deny", by.as_str(), reason.clone()),
        Verdict::Estopped => ("deny", "estop", Some("the e-stop latched".to_owned())),
    };
    tracing::info!(approval = %id, decision, by, "approval decided");
    if let Some(t) = trail {
        let line = Record {
            approval: Some(&id),
            decision: Some(decision),
            approver: Some(by),
            error: reason
                .as_deref()
                .map(|r| clip(r, MAX_ERROR_BYTES).to_owned()),
            ..t.record(Phase::Decision, false)
        };
        t.log.append_async(&line).await?;
    }
    match verdict {
        Verdict::Approved { .. } => Ok(()),
        Verdict::Denied { by, reason } => Err(PluginError::Denied {
            plugin: plugin.to_owned(),
            function: function.to_owned(),
            by,
            reason,
        }),
        Verdict::Estopped => Err(PluginError::Estopped {
            plugin: plugin.to_owned(),
            function: function.to_owned(),
        }),
    }
}

/// Records, when dropped, that a running call was abandoned (written synchronously: there is no task
/// left to await it). Forgotten once the call returns.
struct Abandoned<'a, 'b> {
    trail: &'b Trail<'a>,
    t0: std::time::Instant,
}

impl Drop for Abandoned<'_, '_> {
    fn drop(&mut self) {
        let line = Record {
            outcome: Some(Outcome::Error),
            error_kind: Some("cancelled"),
            error: Some("the call was abandoned: its request went away while it ran".into()),
            duration_us: Some(Record::micros(self.t0.elapsed())),
            result_bytes: Some(0),
            ..self.trail.record(Phase::Outcome, false)
        };
        if let Err(e) = self.trail.log.append_detached(&line) {
            tracing::error!(error = %e, "the outcome of an abandoned call cannot be recorded");
        }
    }
}

/// The audit context of one call.
struct Trail<'a> {
    log: &'a AuditLog,
    /// The plugin (or external server) called, its digest, and whether its arguments are recorded.
    plugin: &'a str,
    sha256: &'a str,
    audit_arguments: bool,
    id: String,
    caller: Caller,
    function: &'a str,
    args: &'a Value,
    args_sha256: String,
}

impl<'a> Trail<'a> {
    fn new(
        log: &'a AuditLog,
        callee: Callee<'a>,
        caller: &Caller,
        function: &'a str,
        args: &'a Value,
    ) -> Self {
        Trail {
            log,
            plugin: callee.name,
            sha256: callee.sha256,
            audit_arguments: callee.audit_arguments,
            id: log.call_id(),
            caller: caller.valid_parts(),
            function: clip(function, MAX_FUNCTION_BYTES),
            args,
            args_sha256: super::sha256_hex(args.to_string().as_bytes()),
        }
    }

    /// The call's line of `phase`, without the outcome fields; `with_args` adds the arguments when the
    /// policy records them.
    fn record(&self, phase: Phase, with_args: bool) -> Record<'_> {
        Record {
            call: &self.id,
            phase,
            time: Record::now(SystemTime::now()),
            conversation: self.caller.conversation.as_deref(),
            key_id: self.caller.key_id.as_deref(),
            peer: self.caller.peer.as_deref(),
            plugin: self.plugin,
            plugin_sha256: self.sha256,
            function: self.function,
            args_sha256: &self.args_sha256,
            args: (with_args && self.audit_arguments).then_some(self.args),
            outcome: None,
            error_kind: None,
            error: None,
            duration_us: None,
            fuel: None,
            result_bytes: None,
            approval: None,
            decision: None,
            approver: None,
        }
    }

    /// Records how the call ended and hands `out` back, or the audit error if the line cannot be made
    /// durable (the result is withheld). A rejected call has no intent line, so its outcome line carries
    /// the arguments (when recorded).
    async fn outcome(
        &self,
        outcome: Outcome,
        out: Result<Value, PluginError>,
        result_bytes: usize,
        report: &CallReport,
    ) -> Result<Value, PluginError> {
        let err = out.as_ref().err();
        let record = Record {
            outcome: Some(outcome),
            error_kind: err.map(PluginError::kind),
            error: err.map(|e| self.error_text(e)),
            duration_us: Some(Record::micros(report.duration)),
            fuel: report.fuel,
            result_bytes: Some(result_bytes),
            ..self.record(Phase::Outcome, outcome == Outcome::Rejected)
        };
        match self.log.append_async(&record).await {
            Ok(()) => out,
            Err(e) => Err(e.into()),
        }
    }

    /// `e` as recorded: bounded, and without the arguments unless the policy records them.
    fn error_text(&self, e: &PluginError) -> String {
        let text = if self.audit_arguments {
            e.to_string()
        } else if let PluginError::Arguments(_) = e {
            "the arguments do not match the function's schema (details not recorded: argument auditing is off)"
                .to_owned()
        } else {
            redact(&e.to_string(), self.args)
        };
        clip(&text, MAX_ERROR_BYTES).to_owned()
    }
}

/// `text` with every string value of `args` (2 characters or more, the longest first) replaced.
pub(super) fn redact(text: &str, args: &Value) -> String {
    fn leaves<'v>(v: &'v Value, out: &mut Vec<&'v str>) {
        match v {
            Value::String(s) if s.chars().nth(1).is_some() => out.push(s),
            Value::Array(a) => a.iter().for_each(|x| leaves(x, out)),
            Value::Object(o) => o.values().for_each(|x| leaves(x, out)),
            _ => {}
        }
    }
    let mut strings = Vec::new();
    leaves(args, &mut strings);
    strings.sort_by_key(|s| std::cmp::Reverse(s.len()));
    strings.dedup();
    let mut text = text.to_owned();
    for s in strings.into_iter().take(MAX_REDACTED) {
        let escaped = Value::from(s).to_string();
        let escaped = &escaped[1..escaped.len() - 1];
        if escaped != s {
            text = text.replace(escaped, REDACTED);
        }
        text = text.replace(s, REDACTED);
    }
    text
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
pub(super) fn clip(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// `s` cut to at most `max` bytes (on a character boundary), saying how much was cut when there is room.
pub(super) fn truncate(s: String, max: usize) -> String {
    if s.len() <= max {
        return s;
    }
    const ROOM: usize = 48;
    if max < ROOM {
        return clip(&s, max).to_owned();
    }
    let head = clip(&s, max - ROOM);
    format!("{head}… [cut: {} bytes in all]", s.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn redacts_argument_strings_raw_and_escaped() {
        let args = json!({"path": "/etc/shadow", "q": ["a\"b", "x"], "n": 5, "nested": {"k": "secretvalue"}});
        let msg = r#"cannot read /etc/shadow; "a\"b" is bad; secretvalue-ish; x stays; 5 stays"#;
        assert_eq!(
            redact(msg, &args),
            r#"cannot read [redacted]; "[redacted]" is bad; [redacted]-ish; x stays; 5 stays"#
        );
    }

    #[test]
    fn cuts_on_char_boundaries() {
        assert_eq!(clip("héllo", 2), "h");
        assert_eq!(clip("héllo", 3), "hé");
        assert_eq!(clip("ab", 5), "ab");
        let long = "é".repeat(1000);
        let t = truncate(long.clone(), 100);
        assert!(t.len() <= 100, "{}", t.len());
        assert!(t.ends_with("[cut: 2000 bytes in all]"), "{t}");
        assert_eq!(truncate(long, 7), "ééé");
        assert_eq!(truncate("short".into(), 100), "short");
    }
}
