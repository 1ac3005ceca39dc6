//! Safe actuators on the real server: the e-stop latch refuses a robot-arm move (`estopped`, before the
//! plugin runs) while the arm's stop still runs, survives a restart, is shown in `/health`, is operated by
//! `thorn estop` and `/v1/thorn/estop` (operator keys only) and latched by SIGUSR1.

use serde_json::{Value, json};
use std::path::Path;
use thorn_plugin::{HostConfig, PluginHost};

/// The robot arm installed and approved with its state directory granted read-write; returns the
/// plugin directory and the policy file.
fn install_arm(dir: &Path) -> (String, String) {
    install_arm_with(dir, json!({}))
}

/// [`install_arm`] with more of the policy entry (`rates`, say).
pub(crate) fn install_arm_with(dir: &Path, more: Value) -> (String, String) {
    let installed = dir.join("plugins");
    let state = dir.join("arm");
    std::fs::create_dir_all(&installed).unwrap();
    std::fs::create_dir_all(&state).unwrap();
    let host = PluginHost::with_config(HostConfig::default()).unwrap();
    let entries = thorn_tests::install_plugins(&host, &installed, &["robot_arm"], |_| {
        let mut e =
            json!({"filesystem": [{"guest": "/state", "host": state, "access": "read-write"}]});
        if let (Some(e), Some(m)) = (e.as_object_mut(), more.as_object()) {
            e.extend(m.clone());
        }
        e
    });
    let policy = dir.join("policy.json");
    std::fs::write(&policy, json!({ "plugins": entries }).to_string()).unwrap();
    (
        installed.display().to_string(),
        policy.display().to_string(),
    )
}

/// A request that forces a call of the host function `function`, and the host call's record.
pub(crate) fn call(addr: std::net::SocketAddr, key: Option<&str>, function: &str) -> Value {
    let body = json!({"messages": [{"role": "user", "content": "Move the arm's base to 10 degrees."}],
        "tools": [{"type": "function", "function": {"name": format!("thorn:{function}")}}],
        "tool_choice": "required", "temperature": 0, "max_tokens": 64, "max_tool_rounds": 1});
    let bearer = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = bearer
        .iter()
        .map(|b| ("Authorization", b.as_str()))
        .collect();
    let r = thorn_tests::http(
        addr,
        "POST",
        "/v1/chat/completions",
        &headers,
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let calls = v["choices"][0]["message"]["thorn_host_tool_calls"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    calls
        .into_iter()
        .find(|c| c["name"] == function)
        .unwrap_or_else(|| panic!("no call of {function}: {v}"))
}

fn estop(addr: std::net::SocketAddr, args: &[&str]) -> std::process::Output {
    std::process::Command::new(thorn_tests::thorn_binary())
        .arg("estop")
        .args(args)
        .arg("--url")
        .arg(format!("http://{addr}"))
        .env_remove("THORN_API_KEY")
        .output()
        .unwrap()
}

fn health(addr: std::net::SocketAddr) -> Value {
    thorn_tests::http(addr, "GET", "/health", &[], b"").json()
}

#[test]
fn the_estop_refuses_moves_lets_stops_run_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let (plugins, policy) = install_arm(dir.path());
    let estop_file = dir.path().join("estop.json").display().to_string();
    let args = [
        "--context",
        "2048",
        "--plugins",
        &plugins,
        "--policy",
        &policy,
        "--estop-file",
        &estop_file,
    ];
    let server = thorn_tests::ServeProcess::start(&args);
    assert_eq!(health(server.addr)["estop"]["latched"], false);
    // Released: a move runs.
    let moved = call(server.addr, None, "move_joints");
    assert!(moved["error_kind"].is_null(), "{moved}");
    // Latched from the CLI: the move is refused before the plugin runs, the stop runs.
    let out = estop(server.addr, &["on"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("LATCHED"));
    // The server logged it, without colour codes (its stderr is not a terminal).
    let t0 = std::time::Instant::now();
    while !server.log().contains("latched=true") {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(30),
            "{}",
            server.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let log = server.log();
    assert!(
        !log.contains('\u{1b}'),
        "ANSI codes in a piped log: {log:?}"
    );
    let refused = call(server.addr, None, "move_joints");
    assert_eq!(refused["error_kind"], "estopped", "{refused}");
    let stopped = call(server.addr, None, "arm_stop");
    assert!(stopped["error_kind"].is_null(), "{stopped}");
    let h = health(server.addr);
    assert_eq!(h["estop"]["latched"], true, "{h}");
    assert_eq!(h["estop"]["by"], "loopback", "{h}");
    drop(server);
    // Restarted: still latched.
    let server = thorn_tests::ServeProcess::start(&args);
    assert_eq!(health(server.addr)["estop"]["latched"], true);
    assert_eq!(
        call(server.addr, None, "move_joints")["error_kind"],
        "estopped"
    );
    // Released over the API; SIGUSR1 latches it again.
    let r = thorn_tests::http(
        server.addr,
        "POST",
        "/v1/thorn/estop",
        &[("Content-Type", "application/json")],
        br#"{"latched": false}"#,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(call(server.addr, None, "move_joints")["error_kind"].is_null());
    server.signal("USR1");
    let t0 = std::time::Instant::now();
    while health(server.addr)["estop"]["latched"] != true {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(30),
            "SIGUSR1 latched it"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(health(server.addr)["estop"]["by"], "signal");
}

#[test]
fn only_operator_keys_operate_the_estop() {
    let dir = tempfile::tempdir().unwrap();
    let (plugins, policy) = install_arm(dir.path());
    let keys = dir.path().join("keys.json");
    std::fs::write(
        &keys,
        json!({"keys": [
            {"id": "robot", "sha256": thorn_tests::sha256_hex(b"sk-robot")},
            {"id": "ops", "sha256": thorn_tests::sha256_hex(b"sk-ops"), "operator": true}
        ]})
        .to_string(),
    )
    .unwrap();
    let estop_file = dir.path().join("estop.json").display().to_string();
    let server = thorn_tests::ServeProcess::start(&[
        "--context",
        "1024",
        "--plugins",
        &plugins,
        "--policy",
        &policy,
        "--estop-file",
        &estop_file,
        "--api-keys",
        &keys.display().to_string(),
    ]);
    let post = |key: &str, on: bool| {
        thorn_tests::http(
            server.addr,
            "POST",
            "/v1/thorn/estop",
            &[
                ("Content-Type", "application/json"),
                ("Authorization", &format!("Bearer {key}")),
            ],
            json!({"latched": on}).to_string().as_bytes(),
        )
    };
    let r = post("sk-robot", true);
    assert_eq!(r.status, 403, "{}", r.body);
    assert!(r.body.contains("operator"), "{}", r.body);
    let r = post("sk-ops", true);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["by"], "ops");
    // The robot's key sees the refusal, and may read the latch.
    assert_eq!(
        call(server.addr, Some("sk-robot"), "move_joints")["error_kind"],
        "estopped"
    );
    let r = thorn_tests::http(
        server.addr,
        "GET",
        "/v1/thorn/estop",
        &[("Authorization", "Bearer sk-robot")],
        b"",
    );
    assert_eq!(r.json()["latched"], true, "{}", r.body);
    // Without a key: 401 before anything.
    let r = thorn_tests::http(server.addr, "GET", "/v1/thorn/estop", &[], b"");
    assert_eq!(r.status, 401);
}

/// A rate limit and a budget of the policy reach the client as the host call's `error_kind`
/// (`rate_limited`, the limit named) and the call metrics count them; the plugin did not run.
#[test]
fn a_rate_limit_and_a_budget_are_reported_to_the_client_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let (plugins, policy) = install_arm_with(
        dir.path(),
        json!({"rates": {"move_joints": {"per_key_per_minute": 1}, "arm_state": {"per_key_per_day": 1}}}),
    );
    let server = thorn_tests::ServeProcess::start(&[
        "--context",
        "2048",
        "--plugins",
        &plugins,
        "--policy",
        &policy,
        "--estop-file",
        &dir.path().join("estop.json").display().to_string(),
    ]);
    assert!(call(server.addr, None, "move_joints")["error_kind"].is_null());
    let limited = call(server.addr, None, "move_joints");
    assert_eq!(limited["error_kind"], "rate_limited", "{limited}");
    assert!(
        limited["error"]
            .as_str()
            .unwrap()
            .contains("at most 1 calls per minute for this key"),
        "{limited}"
    );
    // A budget: one read of the arm per key per day.
    assert!(call(server.addr, None, "arm_state")["error_kind"].is_null());
    let spent = call(server.addr, None, "arm_state");
    assert_eq!(spent["error_kind"], "rate_limited", "{spent}");
    assert!(
        spent["error"]
            .as_str()
            .unwrap()
            .contains("budget of 1 calls for the day is spent"),
        "{spent}"
    );
    let m = thorn_tests::http(server.addr, "GET", "/metrics", &[], b"").body;
    assert!(
        m.contains("thorn_plugin_calls_total{tool=\"move_joints\",outcome=\"rate_limited\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("thorn_plugin_calls_total{tool=\"arm_state\",outcome=\"rate_limited\"} 1"),
        "{m}"
    );
}
