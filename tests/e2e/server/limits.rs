//! What the server refuses or bounds: API keys and their allow-lists, a full queue, a client that goes
//! away, concurrent requests sharing passes, the audit log's caller, slow clients.

use super::*;

/// A server with API keys, a batch of one and a queue of one, for the 401 and 429 cases.
#[test]
fn api_keys_and_a_full_queue() {
    let s = start(
        1024,
        1,
        1,
        ServerConfig {
            keys: keys(),
            max_body: 1 << 20,
            metrics_auth: true,
            ..ServerConfig::default()
        },
    );
    the_keys_decide_who_uses_what(s.addr);
    the_audit_log_says_who(&s);
    let body = json!({"messages": user("hi"), "max_tokens": 2}).to_string();
    let r = http(s.addr, "POST", "/v1/chat/completions", &[], body.as_bytes());
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    let r = http(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer wrong")],
        body.as_bytes(),
    );
    assert_eq!(r.status, 401);
    let auth = [("Authorization", "Bearer sekrit")];
    let r = http(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &auth,
        body.as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    // The Messages API takes the same keys as `x-api-key` (or Bearer) and answers in Anthropic's shape.
    let m = json!({"model": "smollm2", "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    let r = http(s.addr, "POST", "/v1/messages", &[], m.as_bytes());
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(r.json()["type"], "error");
    assert_eq!(
        r.json()["error"]["type"],
        "authentication_error",
        "{}",
        r.body
    );
    let r = http(
        s.addr,
        "POST",
        "/v1/messages",
        &[("x-api-key", "wrong")],
        m.as_bytes(),
    );
    assert_eq!(r.status, 401, "{}", r.body);
    for auth in [("x-api-key", "sekrit"), ("Authorization", "Bearer sekrit")] {
        let r = http(s.addr, "POST", "/v1/messages", &[auth], m.as_bytes());
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["type"], "message", "{}", r.body);
    }
    // Bad bodies are 400s in Anthropic's shape, naming the field.
    for (bad, field) in [
        (
            json!({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}),
            "max_tokens",
        ),
        (
            json!({"model": "smollm2", "max_tokens": 2, "temperature": 1.5,
            "messages": [{"role": "user", "content": "hi"}]}),
            "temperature",
        ),
        (
            json!({"model": "smollm2", "max_tokens": 2, "tool_choice": {"type": "some"},
            "messages": [{"role": "user", "content": "hi"}]}),
            "tool_choice.type",
        ),
        (
            json!({"model": "smollm2", "max_tokens": 2, "thinking": {"type": "maybe"},
            "messages": [{"role": "user", "content": "hi"}]}),
            "thinking",
        ),
    ] {
        let r = http(
            s.addr,
            "POST",
            "/v1/messages",
            &[("x-api-key", "sekrit")],
            bad.to_string().as_bytes(),
        );
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(
            r.json()["error"]["type"],
            "invalid_request_error",
            "{}",
            r.body
        );
        assert!(
            r.json()["error"]["message"]
                .as_str()
                .unwrap()
                .contains(field),
            "{}",
            r.body
        );
    }

    // One long generation running, one waiting: the next is refused with 429 and Retry-After. The long
    // one cannot end early (at least 400 integers, some 800 tokens), so the queue is still full when the
    // third request comes however slow the machine is; both are streamed and dropped (cancelled) after.
    let long = json!({"messages": user("Count from one to one thousand."), "max_tokens": 950,
        "temperature": 0, "stream": true, "response_format": {"type": "json_schema", "json_schema": {
            "name": "n", "schema": {"type": "array", "items": {"type": "integer"}, "minItems": 400}}}})
    .to_string();
    let addr = s.addr;
    let health = |addr| {
        let h = http(addr, "GET", "/health", &[], b"").json();
        (h["busy"] == true, h["queue_depth"].as_u64().unwrap())
    };
    // A streamed response starts once its request is taken by the engine; it runs once the engine is
    // busy with nothing waiting. (Waiting on `busy` alone could see the previous request's last step.)
    let mut first = http_send(addr, "POST", "/v1/chat/completions", &auth, long.as_bytes());
    let line = status_line(&mut first);
    assert!(
        line.contains(" 200 "),
        "the first request streams: {line:?}"
    );
    let t = Instant::now();
    while health(addr) != (true, 0) {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "the first request never ran alone"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let second = http_send(addr, "POST", "/v1/chat/completions", &auth, long.as_bytes());
    while health(addr).1 < 1 {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "the second request never queued"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let r = http(addr, "POST", "/v1/chat/completions", &auth, body.as_bytes());
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    drop((first, second));
}

/// The status line of a response, read off `s`.
fn status_line(s: &mut std::net::TcpStream) -> String {
    use std::io::Read;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n") && s.read(&mut byte).unwrap() == 1 {
        head.push(byte[0]);
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// Starts a streamed generation that cannot end early (at least 1000 integers, some 2000 tokens) and
/// returns its connection once `events` SSE events came: dropping it cancels the generation.
fn endless_generation(addr: SocketAddr, events: usize) -> std::net::TcpStream {
    use std::io::Read;
    let body = json!({"messages": user("List numbers."), "stream": true, "max_tokens": 1800,
        "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "n",
            "schema": {"type": "array", "items": {"type": "integer"}, "minItems": 1000}}}})
    .to_string();
    let mut s = http_send(addr, "POST", "/v1/chat/completions", &[], body.as_bytes());
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while seen.windows(5).filter(|w| *w == b"data:").count() < events {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "the stream ended early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    s
}

#[test]
fn a_client_that_goes_away_cancels_its_generation() {
    let addr = server().addr;
    let cancelled = || -> u64 {
        let m = http(addr, "GET", "/metrics", &[], b"");
        m.body
            .lines()
            .find_map(|l| l.strip_prefix("thorn_cancelled_requests_total "))
            .and_then(|n| n.parse().ok())
            .unwrap()
    };
    let before = cancelled();
    drop(endless_generation(addr, 4));
    let t = Instant::now();
    while cancelled() == before {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "the generation was not cancelled"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn concurrent_requests_share_forward_passes() {
    let addr = server().addr;
    let counter = |name: &str| -> u64 {
        let m = http(addr, "GET", "/metrics", &[], b"");
        m.body
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing from /metrics"))
    };
    let (steps0, seqs0) = (
        counter("thorn_batch_steps_total"),
        counter("thorn_batch_sequences_total"),
    );
    // A generation that cannot end early runs while the short requests come, so they join its forward
    // passes however the threads are scheduled; it is cancelled at the end.
    let running = endless_generation(addr, 2);
    let questions = [
        "Name a color.",
        "Name a fruit.",
        "Name a city.",
        "Name an animal.",
    ];
    let handles: Vec<_> = questions
        .iter()
        .map(|q| {
            let body = json!({"messages": user(q), "max_tokens": 24, "temperature": 0,
                "stop": ["never-appears"]})
            .to_string();
            std::thread::spawn(move || {
                http(addr, "POST", "/v1/chat/completions", &[], body.as_bytes())
            })
        })
        .collect();
    let answers: Vec<Value> = handles
        .into_iter()
        .map(|h| {
            let r = h.join().unwrap();
            assert_eq!(r.status, 200, "{}", r.body);
            r.json()
        })
        .collect();
    // Each answer is what the same question gets alone (greedy is batch-invariant).
    for (q, a) in questions.iter().zip(&answers) {
        let alone = chat(
            json!({"messages": user(q), "max_tokens": 24, "temperature": 0,
            "stop": ["never-appears"]}),
        );
        assert_eq!(
            alone.json()["choices"][0]["message"]["content"],
            a["choices"][0]["message"]["content"],
            "{q}"
        );
    }
    let (steps, seqs) = (
        counter("thorn_batch_steps_total") - steps0,
        counter("thorn_batch_sequences_total") - seqs0,
    );
    drop(running);
    assert!(
        seqs > steps,
        "{seqs} sequences in {steps} steps: nothing was batched"
    );
    assert!(counter("thorn_kv_pages") > 0);
}

fn the_audit_log_says_who(s: &Server) {
    let as_robot = |body: &Value| {
        http(
            s.addr,
            "POST",
            "/v1/chat/completions",
            &[("Authorization", "Bearer r0b0t")],
            body.to_string().as_bytes(),
        )
    };
    let body = json!({"messages": user("What is 17 * 3?"), "max_tokens": 200, "temperature": 0,
        "tool_choice": "required", "conversation_id": "robot-run-1",
        "tools": [{"type": "function", "function": {"name": "thorn:calculator"}}]});
    let r = as_robot(&body);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(!host_calls(&r.json()).is_empty(), "{}", r.body);
    let log = std::fs::read_to_string(s._dir.path().join("audit.jsonl")).unwrap();
    assert!(!log.contains("r0b0t"), "the secret is never logged");
    let mine: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["conversation"] == "robot-run-1")
        .collect();
    assert!(mine.len() >= 2, "an intent and an outcome: {log}");
    for v in &mine {
        assert_eq!(v["key_id"], "robot", "{v}");
        assert!(v["peer"].as_str().unwrap().starts_with("127.0.0.1:"), "{v}");
    }
    // A conversation id that could flood the log is refused before anything runs.
    let mut bad = body.clone();
    bad["conversation_id"] = json!("x".repeat(4096));
    let r = as_robot(&bad);
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "conversation_id");
}

/// `sekrit` may do anything; `robot` only the calculator and not /metrics; `ops` no tools but /metrics.
fn keys() -> Keys {
    use sha2::Digest;
    let sha = |s: &str| {
        sha2::Sha256::digest(s.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    let mut k = Keys::from_secrets(&["sekrit"]);
    k.merge(
        Keys::parse(
            &json!({"keys": [
                {"id": "robot", "sha256": sha("r0b0t"), "tools": ["calculator"]},
                {"id": "ops", "sha256": sha("0ps"), "tools": [], "metrics": true}]})
            .to_string(),
        )
        .unwrap(),
    );
    k
}

fn the_keys_decide_who_uses_what(addr: SocketAddr) {
    let as_key = |key: &str, body: &Value| {
        let auth = format!("Bearer {key}");
        http(
            addr,
            "POST",
            "/v1/chat/completions",
            &[("Authorization", auth.as_str())],
            body.to_string().as_bytes(),
        )
    };
    let with = |tool: &str| {
        json!({"messages": user("What is 2 + 2?"), "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": tool}}]})
    };
    // The robot's key reaches the calculator, not the hostile plugin nor the file reader.
    assert_eq!(as_key("r0b0t", &with("thorn:calculator")).status, 200);
    assert_eq!(as_key("r0b0t", &with("thorn:evaluate")).status, 200);
    for denied in ["thorn:spin", "thorn:hostile", "thorn:read_file"] {
        let r = as_key("r0b0t", &with(denied));
        assert_eq!(r.status, 403, "{denied}: {}", r.body);
        assert_eq!(r.json()["error"]["code"], "permission_denied");
        assert!(
            r.json()["error"]["message"]
                .as_str()
                .unwrap()
                .contains("robot")
        );
    }
    assert_eq!(as_key("0ps", &with("thorn:calculator")).status, 403);
    assert_eq!(as_key("sekrit", &with("thorn:spin")).status, 200);
    // /metrics needs a key that may read it; /health stays open for probes.
    let get = |path: &str, key: Option<&str>| {
        let auth = key.map(|k| format!("Bearer {k}"));
        let h: Vec<(&str, &str)> = auth.iter().map(|a| ("Authorization", a.as_str())).collect();
        http(addr, "GET", path, &h, b"").status
    };
    assert_eq!(get("/metrics", None), 401);
    assert_eq!(get("/metrics", Some("r0b0t")), 403);
    assert_eq!(get("/metrics", Some("0ps")), 200);
    assert_eq!(get("/metrics", Some("sekrit")), 200);
    assert_eq!(get("/health", None), 200);
}

/// A server with small connection and transfer limits.
fn limited() -> Server {
    start(
        1024,
        8,
        2,
        ServerConfig {
            max_body: 1 << 20,
            http: HttpLimits {
                max_connections: 8,
                header_timeout: Duration::from_secs(1),
                body_timeout: Duration::from_secs(2),
                max_inflight_body: 1 << 20,
                request_timeout: None,
            },
            ..ServerConfig::default()
        },
    )
}

/// Whether the server closed `s` (reads end) within `limit`.
fn closed_within(s: &mut std::net::TcpStream, limit: Duration) -> bool {
    use std::io::Read;
    s.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => {
                return !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                );
            }
        }
    }
}

#[test]
fn slow_clients_cannot_hold_the_server() {
    use std::io::Write;
    let s = limited();
    // Slowloris: every connection slot taken by a client that never finishes its headers.
    let mut lorises: Vec<std::net::TcpStream> = (0..16)
        .map(|_| {
            let mut c = std::net::TcpStream::connect(s.addr).unwrap();
            c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                .unwrap();
            c
        })
        .collect();
    // The server closes them (header timeout), so a real client gets through.
    for c in &mut lorises {
        assert!(
            closed_within(c, Duration::from_secs(120)),
            "a slowloris connection stayed open"
        );
    }
    let r = http(s.addr, "GET", "/health", &[], b"");
    assert_eq!(r.status, 200);
    // A body that trickles and stops: 408 once its time is up, and the connection is freed.
    let mut c = std::net::TcpStream::connect(s.addr).unwrap();
    c.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"mess",
    )
    .unwrap();
    let r = read_http(&mut c);
    assert_eq!(r.status, 408, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "body_timeout");
    // Bodies in flight share one budget (1 MiB here), reserved by their declared length: a second large
    // upload while the first is stalled is refused at once with 503, not buffered.
    let upload = |body: &[u8]| {
        let mut c = std::net::TcpStream::connect(s.addr).unwrap();
        c.write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n",
        )
        .unwrap();
        c.write_all(body).unwrap();
        c
    };
    // Neither sends its body: one holds the budget until its time is up (408), the other is refused at
    // once (503), whichever the server reads first.
    let (mut a, mut b) = (upload(b""), upload(b""));
    let (a, b) = (read_http(&mut a), read_http(&mut b));
    let mut statuses = [a.status, b.status];
    statuses.sort_unstable();
    assert_eq!(statuses, [408, 503], "{} / {}", a.body, b.body);
    // And the server still serves.
    let r = http(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        json!({"messages": user("hi"), "max_tokens": 2})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

/// `--max-tokens-default` bounds a request that sets no `max_tokens`; `--max-tokens-limit` bounds one
/// that asks for more; a request asking for less gets what it asked.
#[test]
fn output_tokens_have_a_server_default_and_limit() {
    let s = thorn_tests::ServeProcess::start(&[
        "--context",
        "1024",
        "--max-tokens-default",
        "6",
        "--max-tokens-limit",
        "9",
    ]);
    let ask = |max_tokens: Option<u64>| {
        let mut body = json!({"messages": user("Write a long story about a dragon and a knight."),
            "temperature": 0});
        if let Some(n) = max_tokens {
            body["max_tokens"] = json!(n);
        }
        let r = http(
            s.addr,
            "POST",
            "/v1/chat/completions",
            &[],
            body.to_string().as_bytes(),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        (
            v["usage"]["completion_tokens"].as_u64().unwrap(),
            v["choices"][0]["finish_reason"]
                .as_str()
                .unwrap()
                .to_owned(),
        )
    };
    assert_eq!(ask(None), (6, "length".into()));
    assert_eq!(ask(Some(100)), (9, "length".into()));
    assert_eq!(ask(Some(3)), (3, "length".into()));
}
