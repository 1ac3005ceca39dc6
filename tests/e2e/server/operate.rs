//! Operating the server: a log line per request (`--log-format json`: every stderr line one JSON object),
//! traces to an OTLP collector, and a graceful stop (SIGTERM lets running requests finish for `--shutdown-grace`, then cuts each: a
//! stream ends with a `shutting_down` error event and `[DONE]`, and the process exits).

use serde_json::{Value, json};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// stderr's lines, each parsed as JSON (a line that is not JSON fails the test).
fn json_lines(log: &str) -> Vec<Value> {
    log.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}\n{log}")))
        .collect()
}

/// The access lines logged so far, waiting (at most a minute) until there are `n`.
fn access_lines(s: &thorn_tests::ServeProcess, n: usize) -> Vec<Value> {
    let t0 = Instant::now();
    loop {
        let lines: Vec<Value> = json_lines(&s.log())
            .into_iter()
            .filter(|l| l["target"] == "thorn::access")
            .collect();
        if lines.len() >= n || t0.elapsed() > Duration::from_secs(60) {
            return lines;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

#[test]
fn json_logs_give_one_object_per_line_and_a_line_per_request() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.json");
    std::fs::write(
        &keys,
        json!({"keys": [{"id": "app", "sha256": thorn_tests::sha256_hex(b"sk-app")}]}).to_string(),
    )
    .unwrap();
    let s = thorn_tests::ServeProcess::start(&[
        "--no-plugins",
        "--log-format",
        "json",
        "--api-keys",
        keys.to_str().unwrap(),
    ]);
    let auth = [
        ("Authorization", "Bearer sk-app"),
        ("x-request-id", "client-chosen-1"),
    ];
    let body = json!({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
        "temperature": 0});
    let r = thorn_tests::http(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &auth,
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-request-id"), Some("client-chosen-1"));
    let bad = thorn_tests::http(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &[auth[0]],
        b"{\"messages\": 3}",
    );
    assert_eq!(bad.status, 400, "{}", bad.body);
    let lines = access_lines(&s, 2);
    assert_eq!(lines.len(), 2, "{}", s.log());

    let ok = &lines[0];
    assert_eq!(ok["id"], "client-chosen-1", "{ok}");
    assert_eq!(ok["route"], "/v1/chat/completions", "{ok}");
    assert_eq!(ok["method"], "POST", "{ok}");
    assert_eq!(ok["status"], 200, "{ok}");
    assert_eq!(ok["key"], "app", "{ok}");
    assert_eq!(ok["level"], "INFO", "{ok}");
    assert!(ok["timestamp"].is_string(), "{ok}");
    assert!(ok["duration_ms"].as_f64().is_some_and(|d| d > 0.0), "{ok}");
    let usage = r.json()["usage"].clone();
    assert_eq!(ok["prompt_tokens"], usage["prompt_tokens"], "{ok}");
    assert_eq!(ok["completion_tokens"], usage["completion_tokens"], "{ok}");
    assert_eq!(ok["completion_tokens"], 4, "{ok}");
    assert!(ok["ttft_ms"].as_f64().is_some_and(|t| t > 0.0), "{ok}");
    assert_eq!(ok["finish"], "length", "{ok}");
    assert_eq!(ok["tool_calls"], 0, "{ok}");
    assert!(ok["model"].as_str().is_some_and(|m| !m.is_empty()), "{ok}");
    assert_eq!(ok["complete"], true, "{ok}");

    let failed = &lines[1];
    assert_eq!(failed["status"], 400, "{failed}");
    assert!(failed["error"].is_string(), "{failed}");
    assert!(
        failed["id"].as_str().is_some_and(|i| i.starts_with("req-")),
        "{failed}"
    );
    // The status lines are JSON too, with their message.
    let all = json_lines(&s.log());
    assert!(
        all.iter().any(|l| l["target"] == "thorn::status"
            && l["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("serving the OpenAI API"))),
        "{}",
        s.log()
    );
}

#[test]
fn sigterm_cuts_a_request_still_running_after_the_grace_and_the_process_exits() {
    let dir = tempfile::tempdir().unwrap();
    // A move held for approval runs until someone decides: it is still running when the grace ends.
    let (plugins, policy) =
        crate::safety::install_arm_with(dir.path(), json!({"approval": "destructive"}));
    let estop_file = dir.path().join("estop.json").display().to_string();
    let mut s = thorn_tests::ServeProcess::start(&[
        "--context",
        "2048",
        "--plugins",
        &plugins,
        "--policy",
        &policy,
        "--estop-file",
        &estop_file,
        "--shutdown-grace",
        "1",
    ]);
    let addr = s.addr;
    let stream = std::thread::spawn(move || {
        let body = json!({"messages": [{"role": "user", "content": "Move the arm's base to 10 degrees."}],
            "tools": [{"type": "function", "function": {"name": "thorn:move_joints"}}],
            "tool_choice": "required", "temperature": 0, "max_tokens": 64, "max_tool_rounds": 1,
            "stream": true});
        let r = thorn_tests::http(
            addr,
            "POST",
            "/v1/chat/completions",
            &[],
            body.to_string().as_bytes(),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        r.sse()
    });
    crate::approvals::one_pending(s.addr, None);
    let t0 = Instant::now();
    s.signal("TERM");
    let status = s.wait(Duration::from_secs(30));
    let took = t0.elapsed();
    assert!(
        status.is_some(),
        "still running 30 s after SIGTERM:\n{}",
        s.log()
    );
    let events = stream.join().unwrap();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let error: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(error["error"]["code"], "shutting_down", "{events:?}");
    // The grace was waited for, then the request was cut and the process exited: within the grace and
    // the cut's own bounds (5 s for the cut streams, 2 s for the runtime), with room for a loaded machine.
    assert!(took >= Duration::from_millis(900), "{took:?}");
    assert!(took < Duration::from_secs(20), "{took:?}");
    let log = s.log();
    assert!(
        log.contains("1 request(s) running get 1 s to finish"),
        "{log}"
    );
    assert!(log.contains("cut 1 request(s) still running"), "{log}");
    assert!(log.contains("error=\"shutting_down\""), "{log}");
}

/// An OTLP/HTTP collector in the test: it takes `POST /v1/traces` (JSON) and keeps every span.
fn collector() -> (u16, Arc<Mutex<Vec<Value>>>) {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let spans = Arc::new(Mutex::new(Vec::new()));
    let kept = Arc::clone(&spans);
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let kept = Arc::clone(&kept);
            std::thread::spawn(move || {
                let mut w = conn.try_clone().unwrap();
                let mut r = BufReader::new(conn);
                loop {
                    let mut length = 0usize;
                    let mut line = String::new();
                    loop {
                        line.clear();
                        if r.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        if line == "\r\n" {
                            break;
                        }
                        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap();
                        }
                    }
                    let mut body = vec![0; length];
                    r.read_exact(&mut body).unwrap();
                    let v: Value = serde_json::from_slice(&body).unwrap();
                    for rs in v["resourceSpans"].as_array().into_iter().flatten() {
                        for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
                            for s in ss["spans"].as_array().into_iter().flatten() {
                                kept.lock().unwrap().push(s.clone());
                            }
                        }
                    }
                    let ok = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
                    w.write_all(ok.as_bytes()).unwrap();
                }
            });
        }
    });
    (port, spans)
}

/// A span's string attribute.
fn attr<'a>(span: &'a Value, key: &str) -> Option<&'a str> {
    span["attributes"]
        .as_array()?
        .iter()
        .find(|a| a["key"] == key)?["value"]["stringValue"]
        .as_str()
}

#[test]
fn traces_of_a_request_its_rounds_and_its_tool_call_go_to_an_otlp_collector() {
    let (port, spans) = collector();
    let dir = tempfile::tempdir().unwrap();
    let installed = dir.path().join("plugins");
    std::fs::create_dir_all(&installed).unwrap();
    let host = thorn_plugin::PluginHost::with_config(thorn_plugin::HostConfig::default()).unwrap();
    let entries = thorn_tests::install_plugins(&host, &installed, &["calculator"], |_| json!({}));
    let policy = dir.path().join("policy.json");
    std::fs::write(&policy, json!({ "plugins": entries }).to_string()).unwrap();
    let endpoint = format!("http://127.0.0.1:{port}");
    let s = thorn_tests::ServeProcess::start(&[
        "--plugins",
        installed.to_str().unwrap(),
        "--policy",
        policy.to_str().unwrap(),
        "--otlp-endpoint",
        &endpoint,
        "--otlp-protocol",
        "http/json",
    ]);
    thorn_tests::forced_host_call(s.addr, "thorn:calculator", "What is 6 * 7?");
    // Stopping the server flushes what the batch has not sent yet.
    drop(s);
    let t0 = Instant::now();
    let spans = loop {
        let got = spans.lock().unwrap().clone();
        let named = |n: &str| got.iter().any(|s| s["name"] == n);
        if named("request") && named("tool_call") && named("round") {
            break got;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{got:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let request = spans
        .iter()
        .find(|s| s["name"] == "request" && attr(s, "route") == Some("/v1/chat/completions"))
        .unwrap_or_else(|| panic!("{spans:?}"));
    let (trace, id) = (&request["traceId"], &request["spanId"]);
    let children: Vec<&Value> = spans
        .iter()
        .filter(|s| &s["traceId"] == trace && &s["parentSpanId"] == id)
        .collect();
    let rounds = children.iter().filter(|s| s["name"] == "round").count();
    assert!(rounds >= 1, "{spans:?}");
    let call = children
        .iter()
        .find(|s| s["name"] == "tool_call")
        .unwrap_or_else(|| panic!("{spans:?}"));
    assert_eq!(attr(call, "function"), Some("evaluate"), "{call}");
}
