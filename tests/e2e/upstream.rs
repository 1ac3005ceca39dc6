//! Upstream engines behind thorn's agent loop: a second `thorn serve` as the upstream (a real engine),
//! reached through a front `thorn serve --upstream`, with host tools run at the front; an upstream that
//! dies mid-stream, one that hangs, the circuit breaker; a scripted upstream for what a real one does
//! not do on demand (invalid tool calls, an error inside its stream); llama-server when it is on PATH.

use serde_json::{Value, json};
use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use thorn_plugin::{HostConfig, PluginHost};

/// A plugin directory with the calculator installed, a policy approving it and an audit log.
struct Plugins {
    _dir: tempfile::TempDir,
    plugins: String,
    policy: String,
    audit: std::path::PathBuf,
}

fn calculator() -> Plugins {
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    let host = PluginHost::with_config(HostConfig::default()).unwrap();
    let entries = thorn_tests::install_plugins(&host, &plugins, &["calculator"], |_| json!({}));
    let audit = dir.path().join("audit.jsonl");
    let policy = dir.path().join("policy.json");
    std::fs::write(
        &policy,
        json!({"plugins": entries, "audit": {"path": audit}}).to_string(),
    )
    .unwrap();
    Plugins {
        plugins: plugins.to_str().unwrap().to_owned(),
        policy: policy.to_str().unwrap().to_owned(),
        audit,
        _dir: dir,
    }
}

fn post(addr: std::net::SocketAddr, body: &Value) -> thorn_tests::HttpResponse {
    thorn_tests::http(
        addr,
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    )
}

fn post_as(addr: std::net::SocketAddr, key: &str, body: &Value) -> thorn_tests::HttpResponse {
    let auth = format!("Bearer {key}");
    thorn_tests::http(
        addr,
        "POST",
        "/v1/chat/completions",
        &[
            ("Content-Type", "application/json"),
            ("Authorization", &auth),
        ],
        body.to_string().as_bytes(),
    )
}

fn get(addr: std::net::SocketAddr, path: &str) -> thorn_tests::HttpResponse {
    thorn_tests::http(addr, "GET", path, &[], b"")
}

/// The served requests a thorn's `/metrics` counts for the chat route.
fn chat_requests(addr: std::net::SocketAddr) -> u64 {
    get(addr, "/metrics")
        .body
        .lines()
        .filter(|l| l.starts_with("thorn_requests_total{endpoint=\"/v1/chat/completions\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// Words enough for about `n` prompt tokens.
fn long_prompt(n: usize) -> String {
    let mut s = String::from("Summarize this list in one word: ");
    for i in 0..n {
        s.push_str(["apple ", "river ", "stone ", "cloud "][i % 4]);
    }
    s
}

/// Starts a streamed request and reads until some answer text has arrived; returns the stream and
/// what was read so far.
fn stream_until_content(
    addr: std::net::SocketAddr,
    body: &Value,
) -> (std::net::TcpStream, Vec<u8>) {
    let mut s = thorn_tests::http_send(
        addr,
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    );
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).expect("read the stream");
        assert!(
            n > 0,
            "the stream ended early: {}",
            String::from_utf8_lossy(&raw)
        );
        raw.extend_from_slice(&buf[..n]);
        // The first chunk carries `"content":""`; a later one carries text.
        let text = String::from_utf8_lossy(&raw);
        if text.matches("\"content\":\"").count() >= 2 {
            return (s, raw);
        }
    }
}

/// A front and its upstream, both real thorn engines: the upstream's model is served as `big/MODEL`,
/// host tools run at the front (the upstream has none and sees them as client tools), streaming and
/// the openai SDK work through it, usage adds up over rounds, errors name the upstream, a local-first
/// request spills when its prompt outgrows the local context, and an upstream killed mid-stream ends
/// that stream with an error while the local model serves on.
#[test]
fn a_front_thorn_serves_an_upstream_thorn_with_local_host_tools() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("upstream.key");
    std::fs::write(&key, "sk-upstream-test\n").unwrap();
    let upstream =
        thorn_tests::ServeProcess::start(&["--context", "2048", "--api-key", "sk-upstream-test"]);
    let p = calculator();
    let front = thorn_tests::ServeProcess::start(&[
        "--context",
        "512",
        "--queue",
        "1",
        "--max-batch",
        "1",
        "--plugins",
        &p.plugins,
        "--policy",
        &p.policy,
        "--upstream",
        &format!(
            "big=http://{},key_file={},health_interval=0",
            upstream.addr,
            key.display()
        ),
        "--local-first",
        "big",
    ]);
    let log = front.log();
    assert!(log.contains("upstream big: http://"), "{log}");

    // Its models: the local one, `auto`, the upstream's (discovered with the key).
    let local: String = get(front.addr, "/v1/models").json()["data"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let models = get(front.addr, "/v1/models").json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    let big = format!("big/{local}");
    assert_eq!(ids, [local.as_str(), "auto", big.as_str()], "{models}");
    assert_eq!(models["data"][2]["owned_by"], "big");
    let health = get(front.addr, "/health").json();
    assert_eq!(health["upstreams"][0]["up"], true, "{health}");
    assert_eq!(health["upstreams"][0]["circuit"], "closed");

    // A host tool, the upstream deciding: the call is validated and run here, its result goes back up.
    let before = chat_requests(upstream.addr);
    let r = post(
        front.addr,
        &json!({"model": big, "messages": [{"role": "user", "content": "What is 17 * 3?"}],
            "tools": [{"type": "function", "function": {"name": "thorn:calculator"}}],
            "tool_choice": "required", "temperature": 0, "max_tokens": 60, "max_tool_rounds": 1,
            "conversation_id": "up-1"}),
    );
    assert_eq!(r.status, 200, "{}\n{}", r.body, front.log());
    let v = r.json();
    assert_eq!(v["model"], big, "{v}");
    let calls = &v["choices"][0]["message"]["thorn_host_tool_calls"];
    assert_eq!(calls[0]["name"], "evaluate", "{v}");
    assert!(calls[0]["result"].is_object(), "{v}");
    assert_ne!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    // Two rounds went upstream (the call, then the answer), and usage is their sum.
    assert_eq!(chat_requests(upstream.addr) - before, 2);
    let usage = &v["usage"];
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 100, "{v}");
    assert!(usage["completion_tokens"].as_u64().unwrap() > 0, "{v}");
    // The call was audited here, with the conversation id.
    let audit = std::fs::read_to_string(&p.audit).unwrap();
    assert!(
        audit.lines().any(|l| l.contains("\"evaluate\"")
            && l.contains("\"up-1\"")
            && l.contains("\"intent\"")),
        "{audit}"
    );

    // Streaming: the answer's text arrives in several chunks, with the upstream model's name.
    let r = post(
        front.addr,
        &json!({"model": big, "messages": [{"role": "user", "content": "Name three colors."}],
            "stream": true, "stream_options": {"include_usage": true}, "temperature": 0, "max_tokens": 24}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let events = r.sse();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{}",
        r.body
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let texts = chunks
        .iter()
        .filter(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
        })
        .count();
    assert!(texts >= 2, "{}", r.body);
    assert!(
        chunks.iter().all(|c| c["model"] == big.as_str()),
        "{}",
        r.body
    );
    assert!(
        chunks.last().unwrap()["usage"]["completion_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );

    // The openai SDK's streaming helper, a client tool through the upstream: the deltas it assembled
    // are the call returned.
    if let Some(python) = thorn_tests::client_python() {
        let base = format!("http://{}", front.addr);
        let r = thorn_tests::run_client(&python, "openai_stream_tool_call.py", &[&base, &big]);
        let deltas: String = r["argument_deltas"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_str().unwrap())
            .collect();
        assert_eq!(r["done"][0]["name"], "get_weather", "{r}");
        assert_eq!(r["done"][0]["arguments"], deltas.as_str(), "{r}");
        assert_eq!(
            r["final_calls"][0]["arguments"], r["done"][0]["arguments"],
            "{r}"
        );
        assert_eq!(r["final_finish_reason"], "tool_calls", "{r}");
        let args: Value =
            serde_json::from_str(r["final_calls"][0]["arguments"].as_str().unwrap()).unwrap();
        assert!(args["city"].is_string(), "{r}");
    }

    // Local-first: a prompt the local 512-token context cannot hold goes upstream (2048)...
    let prompt = long_prompt(900);
    let r = post(
        front.addr,
        &json!({"model": "auto", "messages": [{"role": "user", "content": prompt}],
            "temperature": 0, "max_tokens": 8}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["model"], big);
    // ...while the local model by name refuses it, as it would alone.
    let r = post(
        front.addr,
        &json!({"model": local, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    // A short one stays local; the class asks for the upstream outright.
    let short = json!([{"role": "user", "content": "Hi"}]);
    let r = post(front.addr, &json!({"messages": short, "max_tokens": 4}));
    assert_eq!(r.json()["model"], local.as_str(), "{}", r.body);
    let r = post(
        front.addr,
        &json!({"messages": short, "max_tokens": 4, "thorn_model_class": "large"}),
    );
    assert_eq!(r.json()["model"], big, "{}", r.body);
    // The local queue full (one long generation running, one waiting; neither can end early): an
    // `auto` request goes upstream, a request for the local model by name gets the local 429.
    let long = json!({"model": local, "messages": [{"role": "user", "content": "Count from one to one thousand."}],
        "max_tokens": 480, "temperature": 0, "stream": true, "response_format": {"type": "json_schema",
        "json_schema": {"name": "n", "schema": {"type": "array", "items": {"type": "integer"}, "minItems": 200}}}});
    let health = || {
        let h = get(front.addr, "/health").json();
        (h["busy"] == true, h["queue_depth"].as_u64().unwrap())
    };
    let (running, _) = stream_until_content(front.addr, &long);
    let t = std::time::Instant::now();
    while health() != (true, 0) {
        assert!(
            t.elapsed().as_secs() < 120,
            "the first request never ran alone"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let waiting = thorn_tests::http_send(
        front.addr,
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json")],
        long.to_string().as_bytes(),
    );
    while health().1 < 1 {
        assert!(
            t.elapsed().as_secs() < 120,
            "the second request never queued"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let r = post(
        front.addr,
        &json!({"model": "auto", "messages": short, "max_tokens": 4}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["model"], big, "{}", r.body);
    let r = post(
        front.addr,
        &json!({"model": local, "messages": short, "max_tokens": 4}),
    );
    assert_eq!(r.status, 429, "{}", r.body);
    drop((running, waiting));
    // Both were cancelled with their clients; the local engine is free again.
    while health() != (false, 0) {
        assert!(
            t.elapsed().as_secs() < 300,
            "the cancelled requests never ended"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let metrics = get(front.addr, "/metrics").body;
    assert!(
        metrics.contains("thorn_routed_total{upstream=\"big\",reason=\"context\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("thorn_routed_total{upstream=\"big\",reason=\"queue\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("thorn_upstream_requests_total{upstream=\"big\",outcome=\"ok\"}"));

    // The upstream's own refusal (a prompt over its context) is the client's 400, naming it.
    let r = post(
        front.addr,
        &json!({"model": big, "messages": [{"role": "user", "content": long_prompt(2600)}],
            "max_tokens": 8}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(msg.contains("upstream big answered 400"), "{msg}");
    assert_eq!(r.json()["error"]["code"], "upstream_rejected");
    // An unknown upstream model is a 404.
    let r = post(front.addr, &json!({"model": "big/nope", "messages": short}));
    assert_eq!(r.status, 404, "{}", r.body);

    // The upstream dies mid-stream: that stream ends with an error naming it...
    let (mut s, mut raw) = stream_until_content(
        front.addr,
        &json!({"model": big, "messages": [{"role": "user", "content": "Tell me a long story about a fox."}],
            "stream": true, "temperature": 0, "max_tokens": 1000}),
    );
    upstream.signal("KILL");
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw);
    assert!(
        text.contains("upstream big closed its stream before the answer ended"),
        "{text}"
    );
    assert!(text.contains("\"type\":\"upstream_error\""), "{text}");
    // ...the next request to it is a 502 that says it cannot be reached, and the local model serves on.
    let r = post(
        front.addr,
        &json!({"model": big, "messages": short, "max_tokens": 4}),
    );
    assert_eq!(r.status, 502, "{}", r.body);
    assert!(
        r.body.contains("upstream big could not be reached"),
        "{}",
        r.body
    );
    let r = post(
        front.addr,
        &json!({"model": local, "messages": short, "max_tokens": 4}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    // A local-first request that spills to the dead upstream says so (the local engine could not take
    // it either); a short one stays local and is served.
    let r = post(
        front.addr,
        &json!({"model": "auto", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}),
    );
    assert_eq!(r.status, 502, "{}", r.body);
    let r = post(
        front.addr,
        &json!({"model": "auto", "messages": short, "max_tokens": 4}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(get(front.addr, "/health").json()["status"], "ok");
}

/// An upstream that hangs (stopped with SIGSTOP: it accepts connections and says nothing): a stream
/// in progress ends at the idle limit, a new request at the response limit (504s naming it), and after
/// two failures the circuit opens: requests are refused at once (503, Retry-After) while the local
/// model serves on.
#[test]
fn a_hung_upstream_times_out_and_opens_its_circuit() {
    let upstream = thorn_tests::ServeProcess::start(&["--context", "2048"]);
    let front = thorn_tests::ServeProcess::start(&[
        "--context",
        "512",
        "--upstream",
        &format!(
            "slow=http://{},timeout=3s,idle_timeout=3s,failures=2,cooldown=1h,health_interval=0",
            upstream.addr
        ),
    ]);
    let local: String = get(front.addr, "/v1/models").json()["data"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let model = format!("slow/{local}");
    let (mut s, mut raw) = stream_until_content(
        front.addr,
        &json!({"model": model, "messages": [{"role": "user", "content": "Tell me a long story about a fox."}],
            "stream": true, "temperature": 0, "max_tokens": 1000}),
    );
    upstream.signal("STOP");
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw);
    assert!(
        text.contains("upstream slow sent nothing for 3.0 s in the middle of its answer"),
        "{text}"
    );
    let short = json!([{"role": "user", "content": "Hi"}]);
    let r = post(
        front.addr,
        &json!({"model": model, "messages": short, "max_tokens": 4}),
    );
    assert_eq!(r.status, 504, "{}", r.body);
    assert!(
        r.body.contains("did not start its response within 3.0 s"),
        "{}",
        r.body
    );
    // Two failures: open.
    let r = post(
        front.addr,
        &json!({"model": model, "messages": short, "max_tokens": 4}),
    );
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(
        r.body.contains("upstream slow is unavailable"),
        "{}",
        r.body
    );
    assert!(
        r.header("retry-after")
            .is_some_and(|s| s.parse::<u64>().unwrap() > 60)
    );
    let health = get(front.addr, "/health").json();
    assert_eq!(health["upstreams"][0]["circuit"], "open", "{health}");
    let r = post(
        front.addr,
        &json!({"model": local, "messages": short, "max_tokens": 4}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let metrics = get(front.addr, "/metrics").body;
    assert!(
        metrics.contains("thorn_upstream_circuit_open{upstream=\"slow\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("thorn_upstream_errors_total{upstream=\"slow\"} 3"),
        "{metrics}"
    );
    upstream.signal("CONT");
}

/// An OpenAI-compatible server that answers each chat request with the next scripted body and records
/// what it was sent.
struct Scripted {
    addr: std::net::SocketAddr,
    seen: Arc<Mutex<Vec<Value>>>,
}

fn sse_body(chunks: &[Value]) -> String {
    let mut s: String = chunks.iter().map(|c| format!("data: {c}\n\n")).collect();
    s.push_str("data: [DONE]\n\n");
    s
}

fn scripted(answers: Vec<String>) -> Scripted {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    std::thread::spawn(move || {
        let mut answers = answers.into_iter();
        for conn in listener.incoming() {
            let Ok(mut c) = conn else { continue };
            let mut raw = Vec::new();
            let mut buf = [0u8; 8192];
            // Head, then Content-Length bytes of body.
            let (head_end, len) = loop {
                let n = c.read(&mut buf).unwrap_or(0);
                if n == 0 {
                    break (None, 0);
                }
                raw.extend_from_slice(&buf[..n]);
                if let Some(i) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&raw[..i]).to_lowercase();
                    let len = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse().unwrap());
                    break (Some(i + 4), len);
                }
            };
            let Some(start) = head_end else { continue };
            while raw.len() < start + len {
                let n = c.read(&mut buf).unwrap_or(0);
                if n == 0 {
                    break;
                }
                raw.extend_from_slice(&buf[..n]);
            }
            let head = String::from_utf8_lossy(&raw[..start]).into_owned();
            let (ctype, body) = if head.starts_with("GET /v1/models") {
                (
                    "application/json",
                    json!({"object": "list", "data": [{"id": "scripted"}]}).to_string(),
                )
            } else {
                log.lock()
                    .unwrap()
                    .push(serde_json::from_slice(&raw[start..]).unwrap_or(Value::Null));
                ("text/event-stream", answers.next().unwrap_or_default())
            };
            let _ = write!(
                c,
                "HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    Scripted { addr, seen }
}

fn call_chunk(index: usize, name: Option<&str>, args: &str) -> Value {
    let mut f = json!({"arguments": args});
    if let Some(n) = name {
        f["name"] = n.into();
    }
    json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": index, "id": format!("u{index}"),
        "type": "function", "function": f}]}}]})
}

fn usage_chunk(p: u64, c: u64) -> Value {
    json!({"choices": [], "usage": {"prompt_tokens": p, "completion_tokens": c}})
}

fn finish_chunk(why: &str) -> Value {
    json!({"choices": [{"index": 0, "delta": {}, "finish_reason": why}]})
}

/// What a real upstream does not do on demand: invalid tool calls (each goes back to the model as a
/// tool error, never to the plugin, and the valid retry runs), a client call streamed by the upstream in
/// fragments with spaces (sent to the client once validated, re-serialized), and an error the upstream
/// reports inside its stream (a 502 naming it).
#[test]
fn invalid_upstream_calls_go_back_to_the_model_and_never_reach_a_plugin() {
    let answers = vec![
        // Round 1: a call with wrong arguments and one whose arguments are not JSON.
        sse_body(&[
            call_chunk(0, Some("evaluate"), "{\"expr\": 1}"),
            call_chunk(1, Some("evaluate"), "{\"expression\": "),
            finish_chunk("tool_calls"),
            usage_chunk(10, 5),
        ]),
        // Round 2: the corrected call.
        sse_body(&[
            call_chunk(0, Some("evaluate"), "{\"expression\": "),
            call_chunk(0, None, "\"6 * 7\"}"),
            finish_chunk("tool_calls"),
            usage_chunk(20, 6),
        ]),
        // Round 3: the answer.
        sse_body(&[
            json!({"choices": [{"index": 0, "delta": {"content": "It is "}}]}),
            json!({"choices": [{"index": 0, "delta": {"content": "42."}}]}),
            finish_chunk("stop"),
            usage_chunk(30, 4),
        ]),
        // A client call, in fragments with spaces.
        sse_body(&[
            call_chunk(0, Some("get_weather"), "{\"city\": "),
            call_chunk(0, None, "\"Paris\", \"unit\": \"c\"}"),
            finish_chunk("tool_calls"),
        ]),
        // An error inside the stream.
        "data: {\"error\": {\"message\": \"CUDA out of memory\", \"code\": 500}}\n\n".to_owned(),
    ];
    let up = scripted(answers);
    let p = calculator();
    // Two keys: one for every upstream, one kept local.
    let keys = p._dir.path().join("keys.json");
    std::fs::write(
        &keys,
        json!({"keys": [
            {"id": "full", "sha256": thorn_tests::sha256_hex(b"k-full")},
            {"id": "edge", "sha256": thorn_tests::sha256_hex(b"k-edge"), "upstreams": []}]})
        .to_string(),
    )
    .unwrap();
    let front = thorn_tests::ServeProcess::start(&[
        "--plugins",
        &p.plugins,
        "--policy",
        &p.policy,
        "--api-keys",
        keys.to_str().unwrap(),
        "--upstream",
        &format!("fake=http://{}", up.addr),
    ]);
    let post = |addr, body: &Value| post_as(addr, "k-full", body);
    // A key without upstreams is refused the upstream's model, before anything is sent.
    let r = post_as(
        front.addr,
        "k-edge",
        &json!({"model": "fake/scripted", "messages": [{"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(r.status, 403, "{}", r.body);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(msg.contains("may not use the upstream \"fake\""), "{msg}");
    let r = post(
        front.addr,
        &json!({"model": "fake/scripted", "messages": [{"role": "user", "content": "What is 6 * 7?"}],
            "tools": [{"type": "function", "function": {"name": "thorn:calculator"}}],
            "conversation_id": "bad-calls"}),
    );
    assert_eq!(r.status, 200, "{}\n{}", r.body, front.log());
    let v = r.json();
    let m = &v["choices"][0]["message"];
    assert_eq!(m["content"], "It is 42.", "{v}");
    let calls = m["thorn_host_tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 3, "{v}");
    assert_eq!(calls[0]["error_kind"], "arguments", "{v}");
    assert_eq!(calls[1]["error_kind"], "arguments", "{v}");
    assert!(
        calls[1]["error"]
            .as_str()
            .unwrap()
            .contains("not valid JSON"),
        "{v}"
    );
    assert_eq!(calls[2]["arguments"], "{\"expression\":\"6 * 7\"}", "{v}");
    assert!(calls[2]["result"].to_string().contains("42"), "{v}");
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 60, "completion_tokens": 15, "total_tokens": 75,
            "prompt_tokens_details": {"cached_tokens": 0}}),
        "{v}"
    );
    // The model was told what was wrong with each, next to the calls it made.
    let seen = up.seen.lock().unwrap().clone();
    let second = &seen[1]["messages"];
    let tool_msgs: Vec<&Value> = second
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .collect();
    assert_eq!(tool_msgs.len(), 2, "{second}");
    assert!(
        tool_msgs[0]["content"]
            .as_str()
            .unwrap()
            .contains("not run"),
        "{second}"
    );
    assert_eq!(seen[0]["tools"][0]["function"]["name"], "evaluate");
    assert_eq!(seen[0]["stream"], true);
    // Only the valid call reached the plugin (one intent in the audit).
    let audit = std::fs::read_to_string(&p.audit).unwrap();
    let intents = audit
        .lines()
        .filter(|l| l.contains("\"intent\"") && l.contains("\"bad-calls\""))
        .count();
    assert_eq!(intents, 1, "{audit}");

    // A client call streamed in fragments: the client's deltas spell the validated call exactly.
    let weather = json!({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["city"]}}});
    let r = post(
        front.addr,
        &json!({"model": "fake/scripted", "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [weather], "stream": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let mut args = String::new();
    let mut finish = String::new();
    for e in r.sse().iter().filter(|e| *e != "[DONE]") {
        let c: Value = serde_json::from_str(e).unwrap();
        let ch = &c["choices"][0];
        if let Some(a) = ch["delta"]["tool_calls"][0]["function"]["arguments"].as_str() {
            args.push_str(a);
        }
        if let Some(f) = ch["finish_reason"].as_str() {
            finish = f.to_owned();
        }
    }
    assert_eq!(args, "{\"city\":\"Paris\",\"unit\":\"c\"}", "{}", r.body);
    assert_eq!(finish, "tool_calls");

    // An error the upstream reports mid-stream.
    let r = post(
        front.addr,
        &json!({"model": "fake/scripted", "messages": [{"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(r.status, 502, "{}", r.body);
    assert!(
        r.body
            .contains("upstream fake failed while answering: CUDA out of memory"),
        "{}",
        r.body
    );
}

/// llama-server (llama.cpp's OpenAI server, built from the pinned llama-cpp-python sdist) as the
/// upstream, on the same GGUF, started as its docs say for tool calling (`--jinja`): thorn's request
/// reaches it through `model: "llama"` (its first listed model), its answer streams back through the
/// front, and the `response_format` json_schema is passed on so llama-server constrains its own decoding
/// (the answer is JSON of that schema). llama-server has no tool-call format for this model's template
/// (asked directly, it answers a `tool_choice: "required"` request in prose), so tool calls are not
/// checked here. Skipped, with a line saying so, when `llama-server` is not on PATH.
#[test]
fn llama_server_as_an_upstream() {
    let Ok(path) = std::env::var("PATH") else {
        return;
    };
    let Some(bin) = std::env::split_paths(&path)
        .map(|d| d.join("llama-server"))
        .find(|p| p.is_file())
    else {
        println!("skipped: llama-server is not on PATH");
        return;
    };
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut child = std::process::Command::new(bin)
        .arg("-m")
        .arg(thorn_tests::default_model())
        .args([
            "--jinja",
            "-c",
            "4096",
            "-t",
            "1",
            "--host",
            "127.0.0.1",
            "--port",
        ])
        .arg(port.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start llama-server");
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let t0 = std::time::Instant::now();
    while std::net::TcpStream::connect(addr).is_err() || get(addr, "/health").status != 200 {
        assert!(t0.elapsed().as_secs() < 300, "llama-server did not start");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let front = thorn_tests::ServeProcess::start(&["--upstream", &format!("llama=http://{addr}")]);
    let schema = json!({"type": "object", "properties": {"answer": {"type": "integer"}},
        "required": ["answer"]});
    let r = post(
        front.addr,
        &json!({"model": "llama", "messages": [{"role": "user", "content": "What is 17 * 3?"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
            "stream": true, "stream_options": {"include_usage": true}, "temperature": 0, "max_tokens": 40}),
    );
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(r.status, 200, "{}\n{}", r.body, front.log());
    let mut content = String::new();
    let mut usage = Value::Null;
    for e in r.sse().iter().filter(|e| *e != "[DONE]") {
        let c: Value = serde_json::from_str(e).unwrap();
        assert!(c["model"].as_str().unwrap().starts_with("llama/"), "{c}");
        if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
            content.push_str(t);
        }
        if !c["usage"].is_null() {
            usage = c["usage"].clone();
        }
    }
    let answer: Value = serde_json::from_str(&content).unwrap_or_else(|e| panic!("{e}: {content}"));
    assert!(answer["answer"].is_i64(), "{content}");
    assert!(
        usage["completion_tokens"].as_u64().unwrap() > 0,
        "{}",
        r.body
    );
}
