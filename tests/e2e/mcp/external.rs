//! External MCP servers as host tools: named by the policy, bounded where they cross (allowed tools,
//! checked schemas, time, size, malformed JSON-RPC, a server that dies), over stdio and over HTTP with a
//! token, and called by the agent loop.

use super::*;
/// The policy's entry for the test MCP server (`tests/clients/mcp_server.py`, the MCP Python SDK), with
/// the tools `tools` allowed, logging each start to `log`.
fn test_server(python: &std::path::Path, log: &std::path::Path, tools: &[&str]) -> Value {
    let script = thorn_tests::root().join("tests/clients/mcp_server.py");
    json!({"command": [python, script, log], "tools": tools, "timeout_ms": 8000,
        "max_output_kib": 64, "max_concurrent": 2})
}

/// External MCP servers named by the policy become host tools `<server>_<tool>`, bounded where they
/// cross: only allowed tools, schemas checked before a call is sent, no shadowing, and a server that
/// fails, floods, hangs, speaks malformed JSON-RPC or dies ends each call with a typed error while the
/// set keeps serving (and the server is started again).
#[test]
fn external_mcp_servers_are_policy_gated_host_tools() {
    let Some(python) = thorn_tests::client_python() else {
        return;
    };
    let Installed {
        dir,
        plugins: installed,
        host,
        entries,
    } = install(&["calculator", "files"]);
    let audit = dir.path().join("audit.jsonl");
    let starts = dir.path().join("starts.log");
    let clash_starts = dir.path().join("clash.log");
    let policy_path = dir.path().join("policy.json");

    // Not named by the policy: never started.
    std::fs::write(
        &policy_path,
        json!({"plugins": entries, "audit": {"path": audit}}).to_string(),
    )
    .unwrap();
    let policy = thorn_plugin::Policy::load(&policy_path).unwrap();
    let set = thorn_plugin::PluginSet::load_dir(&host, &installed, &policy).unwrap();
    assert!(set.servers().is_empty() && !starts.exists());

    let allowed = ["forecast", "fail", "huge", "hang", "garbage", "missing"];
    std::fs::write(
        &policy_path,
        json!({"plugins": entries, "audit": {"path": audit}, "mcp_servers": {
            "weather": test_server(&python, &starts, &allowed),
            "list": test_server(&python, &clash_starts, &["files"])}})
        .to_string(),
    )
    .unwrap();
    let policy = thorn_plugin::Policy::load(&policy_path).unwrap();
    let set = thorn_plugin::PluginSet::load_dir(&host, &installed, &policy).unwrap();
    let names: Vec<&str> = set
        .tools()
        .tools()
        .iter()
        .map(|t| t.name.as_str())
        .collect();
    for n in [
        "evaluate",
        "list_files",
        "weather_forecast",
        "weather_fail",
        "weather_hang",
    ] {
        assert!(names.contains(&n), "{n} in {names:?}");
    }
    assert!(!names.contains(&"weather_secret"), "not allowed: {names:?}");
    let refusals: Vec<String> = set.refused().iter().map(|r| r.error.to_string()).collect();
    eprintln!("{refusals:#?}");
    // `list_files` stays the files plugin's: the server's tool of that name is refused.
    assert!(
        refusals
            .iter()
            .any(|r| r.contains("list_files") && r.contains("shadows")),
        "{refusals:?}"
    );
    assert!(matches!(
        set.provider_for("list_files"),
        Some(thorn_plugin::Provider::Plugin(_))
    ));
    // An allowed tool the server does not have is reported, not invented.
    assert!(
        refusals.iter().any(|r| r.contains("\"missing\"")),
        "{refusals:?}"
    );
    let weather = set.provider_named("weather").unwrap();
    assert!(!weather.sandboxed());
    let f = weather
        .manifest()
        .functions
        .iter()
        .find(|f| f.name == "weather_forecast")
        .unwrap();
    assert_eq!(
        f.parameters["properties"]["city"]["type"], "string",
        "{f:?}"
    );

    let caller = thorn_plugin::Caller {
        conversation: Some("ext-test".into()),
        ..Default::default()
    };
    let call = |tool: &str, args: Value| set.call(&caller, tool, &args).0;
    let ok = call("weather_forecast", json!({"city": "Oslo"})).unwrap();
    assert_eq!(ok, json!({"city": "Oslo", "temp_c": 21.5, "sky": "clear"}));
    // Checked against the server's schema before anything is sent.
    let e = call("weather_forecast", json!({"city": 5})).unwrap_err();
    assert_eq!(e.kind(), "arguments", "{e}");
    let e = call("weather_secret", json!({})).unwrap_err();
    assert_eq!(e.kind(), "unknown_function", "{e}");
    let e = call("weather_fail", json!({"reason": "dust"})).unwrap_err();
    assert_eq!(e.kind(), "tool", "{e}");
    // (The SDK words the error itself: "Error executing tool fail".)
    assert!(e.to_string().contains("fail"), "{e}");
    // A result over the cap is refused; one far over it is dropped unread and the call times out.
    let e = call("weather_huge", json!({"kib": 100})).unwrap_err();
    assert_eq!(e.kind(), "output", "{e}");
    let e = call("weather_huge", json!({"kib": 4096})).unwrap_err();
    assert_eq!(e.kind(), "timeout", "{e}");
    let e = call("weather_hang", json!({})).unwrap_err();
    assert_eq!(e.kind(), "timeout", "{e}");
    // Calls still work after all of that, on the same process.
    assert_eq!(
        call("weather_forecast", json!({"city": "Rome"})).unwrap()["city"],
        "Rome"
    );
    let started = || std::fs::read_to_string(&starts).unwrap().lines().count();
    assert_eq!(started(), 1);
    // Malformed JSON-RPC and an exit: a typed error, and the next call starts the server again.
    let e = call("weather_garbage", json!({})).unwrap_err();
    assert!(
        ["mcp_server", "timeout"].contains(&e.kind()),
        "{}: {e}",
        e.kind()
    );
    assert_eq!(
        call("weather_forecast", json!({"city": "Lima"})).unwrap()["city"],
        "Lima"
    );
    assert_eq!(started(), 2);

    // Audited as plugin calls are, under the server's name and its entry's digest.
    let log = std::fs::read_to_string(&audit).unwrap();
    let records: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let intents = |f: &str| {
        records
            .iter()
            .filter(|r| r["function"] == f && r["phase"] == "intent")
            .count()
    };
    assert_eq!(intents("weather_forecast"), 3, "{log}");
    assert_eq!(intents("weather_secret"), 0, "{log}");
    assert!(records.iter().all(|r| r["function"] != "weather_forecast"
        || (r["plugin"] == "weather" && r["plugin_sha256"].as_str().unwrap().len() == 64)));
    assert!(
        records
            .iter()
            .any(|r| r["function"] == "weather_hang" && r["error_kind"] == "timeout"),
        "{log}"
    );
}

/// The agent loop calls a policy-approved external MCP server's tool: `thorn serve` with the test
/// server in its policy, a chat request naming `thorn:weather`, the default model choosing the call,
/// the host running it over MCP and the model answering from its result; a hanging tool is a timeout
/// the model is told of, and the server goes on serving. A tool whose schema the decoding grammar
/// cannot take is refused when the set loads. `thorn plugins list` marks the server unsandboxed.
#[test]
fn the_agent_loop_calls_an_external_mcp_servers_tool() {
    let Some(python) = thorn_tests::client_python() else {
        return;
    };
    let Installed {
        dir,
        plugins: installed,
        entries,
        ..
    } = install(&["calculator"]);
    let audit = dir.path().join("audit.jsonl");
    let policy = dir.path().join("policy.json");
    let starts = dir.path().join("starts.log");
    std::fs::write(
        &policy,
        json!({"plugins": entries, "audit": {"path": audit}, "mcp_servers": {
            "weather": test_server(&python, &starts, &["forecast", "hang", "picky"])}})
        .to_string(),
    )
    .unwrap();
    let path = path_str;
    let listed = std::process::Command::new(thorn_tests::thorn_binary())
        .args(["plugins", "list", "--plugins", &path(&installed)])
        .args(["--policy", &path(&policy)])
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout);
    assert!(
        listed.contains("weather") && listed.contains("UNSANDBOXED"),
        "{listed}"
    );

    let server = thorn_tests::ServeProcess::start(&[
        "--context",
        "2048",
        "--plugins",
        &path(&installed),
        "--policy",
        &path(&policy),
    ]);
    let chat = |body: &Value| {
        thorn_tests::http(
            server.addr,
            "POST",
            "/v1/chat/completions",
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        )
    };
    let health = thorn_tests::http(server.addr, "GET", "/health", &[], b"").json();
    assert_eq!(health["mcp_servers"], 1, "{health}\n{}", server.log());
    // A schema the decoding grammar cannot take (`not`) refuses that tool when the set loads, with why;
    // the server's other tools serve.
    let log = server.log();
    assert!(
        log.lines()
            .any(|l| l.contains("weather_picky") && l.contains("grammar") && l.contains("not")),
        "{log}"
    );
    let body = json!({"messages": [{"role": "user",
            "content": "What is the weather forecast for Oslo tomorrow?"}],
        "tools": [{"type": "function", "function": {"name": "thorn:weather"}}],
        "tool_choice": "required", "temperature": 0, "max_tokens": 120,
        "conversation_id": "ext-agent"});
    let r = chat(&body);
    assert_eq!(r.status, 200, "{}\n{}", r.body, server.log());
    let v = r.json();
    let calls = v["choices"][0]["message"]["thorn_host_tool_calls"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(!calls.is_empty(), "{v}");
    assert_eq!(calls[0]["name"], "weather_forecast", "{v}");
    // The server's own answer came back through the loop.
    assert_eq!(calls[0]["result"]["sky"], "clear", "{}", calls[0]);
    assert_eq!(calls[0]["result"]["temp_c"], 21.5);
    assert_ne!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    let log = std::fs::read_to_string(&audit).unwrap();
    assert!(
        log.lines().any(|l| l.contains("\"weather_forecast\"")
            && l.contains("\"ext-agent\"")
            && l.contains("\"intent\"")),
        "{log}"
    );

    // A server that hangs: the call is a timeout the model is told of, and the server keeps serving.
    let hang = json!({"messages": [{"role": "user", "content": "Wait for it."}],
        "tools": [{"type": "function", "function": {"name": "thorn:weather_hang"}}],
        "tool_choice": {"type": "function", "function": {"name": "weather_hang"}},
        "temperature": 0, "max_tokens": 40, "max_tool_rounds": 1});
    let r = chat(&hang);
    assert_eq!(r.status, 200, "{}\n{}", r.body, server.log());
    let v = r.json();
    let calls = &v["choices"][0]["message"]["thorn_host_tool_calls"];
    assert_eq!(calls[0]["name"], "weather_hang", "{v}");
    assert_eq!(calls[0]["error_kind"], "timeout", "{v}");
    let again = chat(&body);
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(
        again.json()["choices"][0]["message"]["thorn_host_tool_calls"][0]["result"]["sky"],
        "clear"
    );
}

/// An external MCP server already running, reached over Streamable HTTP with a bearer token from a file:
/// its allowed tools are host tools, a call past the time limit is a timeout, a wrong token refuses the
/// server with the reason, and a server that goes away fails its calls with a typed error while the
/// plugins keep serving.
#[test]
fn an_external_mcp_server_over_http_with_a_token() {
    let Some(python) = thorn_tests::client_python() else {
        return;
    };
    let Installed {
        dir,
        plugins: installed,
        host,
        entries,
    } = install(&["calculator"]);
    let port_file = dir.path().join("port");
    let mut web = std::process::Command::new(&python)
        .arg(thorn_tests::root().join("tests/clients/mcp_server.py"))
        .arg("--http")
        .arg(&port_file)
        .arg("t0ken")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while !port_file.exists() {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(120),
            "the HTTP server did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let port = std::fs::read_to_string(&port_file).unwrap();
    let url = format!("http://127.0.0.1:{port}/mcp");
    let load = |token: &str| {
        std::fs::write(dir.path().join("token"), format!("{token}\n")).unwrap();
        let policy_path = dir.path().join("policy.json");
        std::fs::write(
            &policy_path,
            json!({"plugins": entries, "mcp_servers": {"web": {"url": url,
                "bearer_file": "token", "tools": ["forecast", "hang"], "timeout_ms": 8000}}})
            .to_string(),
        )
        .unwrap();
        let policy = thorn_plugin::Policy::load(&policy_path).unwrap();
        thorn_plugin::PluginSet::load_dir(&host, &installed, &policy).unwrap()
    };

    let refused = load("wrong");
    assert!(refused.servers().is_empty());
    let why = refused.refused()[0].error.to_string();
    assert!(why.contains("web") && why.contains("401"), "{why}");

    let set = load("t0ken");
    assert!(set.refused().is_empty(), "{:?}", set.refused());
    let caller = thorn_plugin::Caller::default();
    let call = |tool: &str, args: Value| set.call(&caller, tool, &args).0;
    assert_eq!(
        call("web_forecast", json!({"city": "Oslo"})).unwrap()["sky"],
        "clear"
    );
    let e = call("web_hang", json!({})).unwrap_err();
    assert_eq!(e.kind(), "timeout", "{e}");
    assert_eq!(
        call("web_forecast", json!({"city": "Kyiv"})).unwrap()["city"],
        "Kyiv"
    );

    // The server goes away: its calls fail with a typed error; the plugins go on.
    web.kill().unwrap();
    web.wait().unwrap();
    let e = call("web_forecast", json!({"city": "Oslo"})).unwrap_err();
    assert!(
        ["mcp_server", "timeout"].contains(&e.kind()),
        "{}: {e}",
        e.kind()
    );
    assert_eq!(
        call("evaluate", json!({"expression": "6 * 7"})).unwrap()["value"],
        42.0
    );
}
