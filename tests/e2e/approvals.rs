//! Human approval on the real server: a robot-arm move under `approval: destructive` waits (listed at
//! `/v1/thorn/approvals`, announced on the request's stream), runs once an approving key decides through
//! `thorn approvals`, is denied when nobody decides in time (the model is told), cannot be approved by a
//! key without the right or by the request's own key, is refused when the e-stop latches, and is
//! withdrawn when its client goes away; every step is in the audit log.

use super::safety::{call, install_arm_with};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const ROBOT: &str = "sk-robot";
const OPS: &str = "sk-ops";

fn keys(dir: &std::path::Path) -> String {
    let keys = dir.join("keys.json");
    std::fs::write(
        &keys,
        json!({"keys": [
            {"id": "robot", "sha256": thorn_tests::sha256_hex(ROBOT.as_bytes())},
            {"id": "ops", "sha256": thorn_tests::sha256_hex(OPS.as_bytes()), "approve": true, "operator": true}
        ]})
        .to_string(),
    )
    .unwrap();
    keys.display().to_string()
}

fn serve(dir: &std::path::Path, entry: Value, with_keys: bool) -> thorn_tests::ServeProcess {
    let (plugins, policy) = install_arm_with(dir, entry);
    let estop_file = dir.join("estop.json").display().to_string();
    let keys = keys(dir);
    let mut args = vec![
        "--context",
        "2048",
        "--plugins",
        &plugins,
        "--policy",
        &policy,
        "--estop-file",
        &estop_file,
    ];
    if with_keys {
        args.extend(["--api-keys", &keys]);
    }
    thorn_tests::ServeProcess::start(&args)
}

fn bearer(key: Option<&str>) -> Vec<(&'static str, String)> {
    key.map(|k| ("Authorization", format!("Bearer {k}")))
        .into_iter()
        .collect()
}

fn get(addr: SocketAddr, key: Option<&str>, path: &str) -> thorn_tests::HttpResponse {
    let h = bearer(key);
    let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
    thorn_tests::http(addr, "GET", path, &h, b"")
}

fn decide(addr: SocketAddr, key: Option<&str>, id: &str, body: Value) -> thorn_tests::HttpResponse {
    let h = bearer(key);
    let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
    thorn_tests::http(
        addr,
        "POST",
        &format!("/v1/thorn/approvals/{id}"),
        &h,
        body.to_string().as_bytes(),
    )
}

/// Waits (at most a minute, generous for a loaded machine) until exactly one call waits; returns it.
pub(crate) fn one_pending(addr: SocketAddr, key: Option<&str>) -> Value {
    let t0 = Instant::now();
    loop {
        let r = get(addr, key, "/v1/thorn/approvals");
        assert_eq!(r.status, 200, "{}", r.body);
        let data = r.json()["data"].as_array().cloned().unwrap_or_default();
        if let [one] = data.as_slice() {
            return one.clone();
        }
        assert!(data.len() <= 1, "{data:?}");
        assert!(t0.elapsed() < Duration::from_secs(60), "no call waited");
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// A streamed request forcing a move, on a thread: its SSE `data:` payloads.
fn streamed_move(
    addr: SocketAddr,
    key: Option<&'static str>,
) -> std::thread::JoinHandle<Vec<Value>> {
    std::thread::spawn(move || {
        let body = json!({"messages": [{"role": "user", "content": "Move the arm's base to 10 degrees."}],
            "tools": [{"type": "function", "function": {"name": "thorn:move_joints"}}],
            "tool_choice": "required", "temperature": 0, "max_tokens": 64, "max_tool_rounds": 1,
            "stream": true});
        let h = bearer(key);
        let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let r = thorn_tests::http(
            addr,
            "POST",
            "/v1/chat/completions",
            &h,
            body.to_string().as_bytes(),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        r.sse()
            .iter()
            .filter_map(|d| serde_json::from_str(d).ok())
            .collect()
    })
}

/// Sends a POST to the chat route (with `key`, unless empty) on a keep-alive connection (as SDK clients do; a client that said
/// `Connection: close` is noticed going away only when the server next writes to it) and returns it.
pub(crate) fn keep_alive_request(addr: SocketAddr, key: &str, body: &Value) -> std::net::TcpStream {
    use std::io::Write;
    let body = body.to_string();
    let auth = match key {
        "" => String::new(),
        k => format!("Authorization: Bearer {k}\r\n"),
    };
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

fn cli(addr: SocketAddr, key: &str, args: &[&str]) -> std::process::Output {
    std::process::Command::new(thorn_tests::thorn_binary())
        .arg("approvals")
        .args(args)
        .arg("--url")
        .arg(format!("http://{addr}"))
        .env("THORN_API_KEY", key)
        .output()
        .unwrap()
}

fn audit(dir: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("audit.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn a_move_waits_for_an_approving_key_and_runs_once_approved_through_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let server = serve(dir.path(), json!({"approval": "destructive"}), true);
    let addr = server.addr;
    let stream = streamed_move(addr, Some(ROBOT));
    let waiting = one_pending(addr, Some(OPS));
    let id = waiting["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("apv_"), "{waiting}");
    assert_eq!(waiting["function"], "move_joints");
    assert_eq!(waiting["plugin"], "robot_arm");
    assert_eq!(waiting["key_id"], "robot");
    let h = thorn_tests::http(
        addr,
        "GET",
        "/health",
        &[("Authorization", "Bearer sk-ops")],
        b"",
    );
    assert_eq!(h.json()["approvals_pending"], 1, "{}", h.body);
    assert!(waiting["arguments"].is_object(), "{waiting}");
    assert_eq!(
        get(addr, Some(OPS), &format!("/v1/thorn/approvals/{id}")).json()["id"],
        id
    );

    // The robot's key has no approve right: it can neither list nor approve.
    assert_eq!(get(addr, Some(ROBOT), "/v1/thorn/approvals").status, 403);
    let r = decide(addr, Some(ROBOT), &id, json!({"decision": "approve"}));
    assert_eq!(r.status, 403, "{}", r.body);
    assert!(r.body.contains("approve"), "{}", r.body);
    let out = cli(addr, ROBOT, &["approve", &id]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("403"),
        "{out:?}"
    );

    // Other requests keep being served while the call waits.
    assert!(call(addr, Some(ROBOT), "arm_state")["error_kind"].is_null());

    // Listed and approved through the CLI with the approving key: the move runs.
    let out = cli(addr, OPS, &["list"]);
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && listed.contains(&id), "{out:?}");
    assert!(listed.contains("move_joints"), "{listed}");
    let out = cli(addr, OPS, &["approve", &id]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("approved"),
        "{out:?}"
    );

    let events = stream.join().unwrap();
    let pending: Vec<&Value> = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"].get("thorn_approval_pending"))
        .collect();
    assert_eq!(pending.len(), 1, "{events:?}");
    assert_eq!(pending[0]["id"], id.as_str());
    assert_eq!(pending[0]["function"], "move_joints");
    assert!(pending[0]["call_id"].as_str().unwrap().starts_with("call_"));
    let result = events
        .iter()
        .find_map(|e| e["choices"][0]["delta"].get("thorn_host_tool_result"))
        .expect("the move's result");
    assert!(result["error_kind"].is_null(), "{result}");
    assert!(result["result"]["base"].is_number(), "{result}");
    assert!(
        get(addr, Some(OPS), "/v1/thorn/approvals").json()["data"]
            .as_array()
            .unwrap()
            .is_empty()
    );

    // The audit log has the wait and the decision, with the approver, before the call ran.
    let lines = audit(dir.path());
    let phases: Vec<&str> = lines
        .iter()
        .filter(|l| l["function"] == "move_joints")
        .map(|l| l["phase"].as_str().unwrap())
        .collect();
    assert_eq!(
        phases,
        ["pending", "decision", "intent", "outcome"],
        "{lines:?}"
    );
    let decision = lines.iter().find(|l| l["phase"] == "decision").unwrap();
    assert_eq!(decision["decision"], "approve");
    assert_eq!(decision["approver"], "ops");
    assert_eq!(decision["approval"], id.as_str());

    // A request's own key may not approve its call (the policy does not allow it), but may deny it.
    let own = streamed_move(addr, Some(OPS));
    let waiting = one_pending(addr, Some(OPS));
    let id = waiting["id"].as_str().unwrap();
    let r = decide(addr, Some(OPS), id, json!({"decision": "approve"}));
    assert_eq!(r.status, 403, "{}", r.body);
    assert!(r.body.contains("approve_own"), "{}", r.body);
    let r = decide(
        addr,
        Some(OPS),
        id,
        json!({"decision": "deny", "reason": "not now"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        decide(addr, Some(OPS), id, json!({"decision": "approve"})).status,
        404
    );
    let events = own.join().unwrap();
    let result = events
        .iter()
        .find_map(|e| e["choices"][0]["delta"].get("thorn_host_tool_result"))
        .expect("the move's result");
    assert_eq!(result["error_kind"], "denied", "{result}");
    assert!(
        result["error"].as_str().unwrap().contains("not now"),
        "{result}"
    );

    // A client that goes away withdraws its waiting call (long before its minute runs out).
    let body = json!({"messages": [{"role": "user", "content": "Move the arm's base to 10 degrees."}],
        "tools": [{"type": "function", "function": {"name": "thorn:move_joints"}}],
        "tool_choice": "required", "temperature": 0, "max_tokens": 64, "stream": true});
    let gone = keep_alive_request(addr, ROBOT, &body);
    let id = one_pending(addr, Some(OPS))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    drop(gone);
    let t0 = Instant::now();
    let decision = loop {
        let found = audit(dir.path())
            .into_iter()
            .find(|l| l["phase"] == "decision" && l["approval"] == id.as_str());
        if let Some(d) = found {
            break d;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "still waiting");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        (decision["decision"].as_str(), decision["approver"].as_str()),
        (Some("deny"), Some("cancelled")),
        "{decision}"
    );
    assert!(
        get(addr, Some(OPS), "/v1/thorn/approvals").json()["data"]
            .as_array()
            .unwrap()
            .is_empty()
    );

    // The e-stop denies a waiting call (refused as estopped); on Anthropic's stream this time.
    let model = get(addr, Some(ROBOT), "/v1/models").json()["data"][0]["id"].clone();
    let refused = std::thread::spawn(move || {
        let body = json!({"model": model, "max_tokens": 64, "stream": true, "temperature": 0,
            "messages": [{"role": "user", "content": "Move the arm's base to 10 degrees."}],
            "tools": [{"name": "thorn:move_joints"}], "tool_choice": {"type": "any"}});
        let r = thorn_tests::http(
            addr,
            "POST",
            "/v1/messages",
            &[("x-api-key", ROBOT)],
            body.to_string().as_bytes(),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        r.sse()
            .iter()
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .collect::<Vec<_>>()
    });
    one_pending(addr, Some(OPS));
    let out = std::process::Command::new(thorn_tests::thorn_binary())
        .args(["estop", "on", "--url", &format!("http://{addr}")])
        .env("THORN_API_KEY", OPS)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let events = refused.join().unwrap();
    let pending = events
        .iter()
        .find(|e| e["type"] == "thorn_approval_pending")
        .expect("the wait announced");
    assert_eq!(pending["approval"]["function"], "move_joints", "{pending}");
    let result = events
        .iter()
        .find(|e| e["type"] == "thorn_host_tool_result")
        .expect("the move's result");
    assert_eq!(result["call"]["error_kind"], "estopped", "{result}");
    assert!(
        get(addr, Some(OPS), "/v1/thorn/approvals").json()["data"]
            .as_array()
            .unwrap()
            .is_empty()
    );
}

#[test]
fn an_undecided_move_is_denied_when_its_time_runs_out_and_the_model_is_told() {
    let dir = tempfile::tempdir().unwrap();
    let server = serve(
        dir.path(),
        json!({"approval": "never", "functions": {"move_joints": {"approval": "always", "approval_timeout_ms": 1500}}}),
        false,
    );
    let addr = server.addr;
    // Nobody decides: denied after its time, and the model is told why.
    let t0 = Instant::now();
    let denied = call(addr, None, "move_joints");
    assert!(t0.elapsed() >= Duration::from_millis(1500), "it waited");
    assert_eq!(denied["error_kind"], "denied", "{denied}");
    let why = denied["error"].as_str().unwrap();
    assert!(
        why.contains("timeout") && why.contains("nobody approved it"),
        "{why}"
    );
    // Read-only and stop functions are not held (the policy names only move_joints).
    assert!(call(addr, None, "arm_state")["error_kind"].is_null());
    assert!(call(addr, None, "arm_stop")["error_kind"].is_null());
    let lines = audit(dir.path());
    let decision = lines.iter().find(|l| l["phase"] == "decision").unwrap();
    assert_eq!(
        (decision["decision"].as_str(), decision["approver"].as_str()),
        (Some("deny"), Some("timeout"))
    );
    assert!(
        !lines
            .iter()
            .any(|l| l["function"] == "move_joints" && l["phase"] == "intent"),
        "a denied call never runs: {lines:?}"
    );
}

/// An MCP client that supports elicitation is asked to decide a held call (the MCP Python SDK over
/// `thorn mcp`): accepting runs it, declining denies it; a client without elicitation gets its held call
/// denied when its time runs out.
#[test]
fn an_mcp_client_decides_a_held_call_by_elicitation() {
    let Some(python) = thorn_tests::client_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (plugins, policy) = install_arm_with(
        dir.path(),
        json!({"approval": "destructive", "approval_timeout_ms": 1500}),
    );
    let out = thorn_tests::run_client(
        &python,
        "mcp_approval.py",
        &[
            thorn_tests::thorn_binary().to_str().unwrap(),
            &plugins,
            &policy,
        ],
    );
    let asked = out["asked"].as_array().unwrap();
    assert_eq!(asked.len(), 2, "{out}");
    let message = asked[0]["message"].as_str().unwrap();
    assert!(
        message.contains("robot_arm.move_joints") && message.contains("\"base\":10"),
        "{message}"
    );
    assert_eq!(
        asked[0]["requestedSchema"]["properties"]["approve"]["type"],
        "boolean"
    );
    assert_ne!(out["approved"]["isError"], true, "{out}");
    assert_eq!(out["approved"]["structuredContent"]["base"], 10.0, "{out}");
    assert_eq!(out["declined"]["isError"], true, "{out}");
    assert!(out["declined"].to_string().contains("declined"), "{out}");
    assert_eq!(
        out["state"]["structuredContent"]["base"], 10.0,
        "the declined move did not run: {out}"
    );
    assert_eq!(out["unasked"]["isError"], true, "{out}");
    assert!(
        out["unasked"].to_string().contains("nobody approved it"),
        "{out}"
    );
    let lines = audit(dir.path());
    let decisions: Vec<(&str, &str)> = lines
        .iter()
        .filter(|l| l["phase"] == "decision")
        .map(|l| {
            (
                l["decision"].as_str().unwrap(),
                l["approver"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        decisions,
        [
            ("approve", "mcp-elicitation"),
            ("deny", "mcp-elicitation"),
            ("deny", "timeout")
        ]
    );
}
