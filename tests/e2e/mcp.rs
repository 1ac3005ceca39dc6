//! thorn as an MCP server, driven by the MCP Python SDK (pinned in `tests/clients/requirements.txt`):
//! `thorn mcp` started as a child process over stdio, as a desktop agent starts its tools
//! (`tests/clients/mcp_stdio.py`: list, a call, a schema violation, a plugin timeout, an unknown tool,
//! and a call after all of that), and `thorn serve`'s `/mcp` over Streamable HTTP under API keys, with a
//! plugin installed while clients are connected (`tests/clients/mcp_http.py`).

use serde_json::{Value, json};
use thorn_plugin::{HostConfig, PluginHost};

mod external;

#[test]
fn an_mcp_client_lists_and_calls_the_sandboxed_tools_over_stdio() {
    let Some(python) = thorn_tests::client_python() else {
        return;
    };
    let thorn = thorn_tests::thorn_binary();
    let dir = tempfile::tempdir().unwrap();
    let installed = dir.path().join("plugins");
    let data = dir.path().join("data");
    std::fs::create_dir_all(&installed).unwrap();
    std::fs::create_dir_all(&data).unwrap();
    let host = PluginHost::with_config(HostConfig::default()).unwrap();
    let entries =
        thorn_tests::install_plugins(&host, &installed, &["calculator", "hostile"], |name| {
            match name {
                "hostile" => thorn_tests::hostile_grants(&data),
                _ => json!({}),
            }
        });
    let audit = dir.path().join("audit.jsonl");
    let policy = dir.path().join("policy.json");
    std::fs::write(
        &policy,
        json!({"plugins": entries, "audit": {"path": audit}}).to_string(),
    )
    .unwrap();
    let out = thorn_tests::run_client(
        &python,
        "mcp_stdio.py",
        &[
            thorn.to_str().unwrap(),
            installed.to_str().unwrap(),
            policy.to_str().unwrap(),
        ],
    );
    eprintln!("{out}");
    assert_eq!(out["server"]["name"], "thorn");

    // Every function of every admitted plugin, with its schemas and the manifest's hints.
    let evaluate = &out["tools"]["evaluate"];
    assert_eq!(
        evaluate["inputSchema"]["properties"]["expression"]["type"],
        "string"
    );
    assert_eq!(
        evaluate["outputSchema"]["properties"]["value"]["type"],
        "number"
    );
    assert_eq!(evaluate["annotations"]["readOnlyHint"], true, "{evaluate}");
    assert_eq!(evaluate["annotations"]["destructiveHint"], false);
    assert!(out["tools"]["spin"].is_object(), "{}", out["tools"]);

    // A call returns the plugin's JSON, structured and as text.
    let call = &out["call"];
    assert_eq!(call["isError"], false, "{call}");
    assert_eq!(call["structuredContent"]["value"], 51.0);
    let text: Value = serde_json::from_str(call["content"][0]["text"].as_str().unwrap()).unwrap();
    assert_eq!(text["value"], 51.0);

    // Failures are results the model can read, and the server keeps serving.
    for case in ["bad_arguments", "timeout"] {
        assert_eq!(out[case]["isError"], true, "{case}: {}", out[case]);
        assert!(out[case]["content"][0]["text"].is_string(), "{}", out[case]);
    }
    let violation = out["bad_arguments"]["content"][0]["text"].as_str().unwrap();
    assert!(violation.contains("expression"), "{violation}");
    assert!(
        out["unknown"].as_str().unwrap().contains("no_such_tool"),
        "{}",
        out["unknown"]
    );
    assert_eq!(out["after"]["structuredContent"]["value"], 1024.0);

    // Every call that reached a plugin was audited, as the MCP caller's.
    let log = std::fs::read_to_string(&audit).unwrap();
    let records: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        records
            .iter()
            .any(|r| r["function"] == "evaluate" && r["conversation"] == "mcp-test"),
        "{log}"
    );
    assert!(records.iter().any(|r| r["function"] == "spin"), "{log}");
}

/// A fresh directory with the test plugins `names` installed into its `plugins/` (files granted its
/// `docs/`, which holds notes.txt, as `/data`), the host they were pinned with, and their policy entries.
struct Installed {
    dir: tempfile::TempDir,
    plugins: std::path::PathBuf,
    host: PluginHost,
    entries: serde_json::Map<String, Value>,
}

/// `thorn mcp` answers a line that is not JSON with JSON-RPC's parse error (id null) and goes on serving:
/// a client that sent garbage learns why instead of waiting for a reply that never comes.
#[test]
fn thorn_mcp_answers_a_line_that_is_not_json_with_a_parse_error() {
    use std::io::{BufRead, Write};
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(thorn_tests::thorn_binary())
        .args(["mcp", "--plugin-poll", "0", "--plugins"])
        .arg(dir.path())
        .arg("--policy")
        .arg(dir.path().join("policy.json"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "raw", "version": "0"}}});
    writeln!(stdin, "this is not json\n{init}").unwrap();
    stdin.flush().unwrap();
    // Both answers are read before stdin closes: at end of input the server stops, and a request still
    // being handled then may go unanswered.
    let lines: Vec<Value> = std::io::BufReader::new(child.stdout.take().unwrap())
        .lines()
        .take(2)
        .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
        .collect();
    drop(stdin);
    let _ = child.wait();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0]["error"]["code"], -32700, "{lines:?}");
    assert!(lines[0]["id"].is_null());
    assert_eq!(lines[1]["id"], 1);
    assert_eq!(lines[1]["result"]["serverInfo"]["name"], "thorn");
}

fn install(names: &[&str]) -> Installed {
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("plugins");
    let docs = dir.path().join("docs");
    for d in [&plugins, &docs] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(docs.join("notes.txt"), "The launch code is 4242.\n").unwrap();
    let host = PluginHost::with_config(HostConfig::default()).unwrap();
    let entries = thorn_tests::install_plugins(&host, &plugins, names, |name| match name {
        "files" => json!({"filesystem": [{"guest": "/data", "host": docs, "access": "read"}]}),
        _ => json!({}),
    });
    Installed {
        dir,
        plugins,
        host,
        entries,
    }
}

fn path_str(p: &std::path::Path) -> String {
    p.to_str().unwrap().to_owned()
}

/// `thorn serve`'s `/mcp` with two API keys (one limited to the calculator), driven by the MCP Python
/// SDK over Streamable HTTP (`tests/clients/mcp_http.py`): a 2025-11-25 session and a 2026-07-28
/// client list and call, a key is refused a tool outside its allow-list, requests without a key or
/// with a foreign Host or Origin are refused before the protocol, and installing and approving a
/// plugin while both are connected tells both that the tool list changed and serves the new tool.
#[test]
fn mcp_clients_list_and_call_over_http_under_the_api_keys() {
    let Some(python) = thorn_tests::client_python() else {
        return;
    };
    let Installed {
        dir,
        plugins: installed,
        host,
        mut entries,
    } = install(&["calculator", "files"]);
    let audit = dir.path().join("audit.jsonl");
    let policy = dir.path().join("policy.json");
    let write_policy = |path: &std::path::Path, entries: &serde_json::Map<String, Value>| {
        std::fs::write(
            path,
            json!({"plugins": entries, "audit": {"path": audit}}).to_string(),
        )
        .unwrap();
    };
    write_policy(&policy, &entries);
    // What the operator will approve while the server runs.
    let units = thorn_tests::plugin_wasm("units");
    let units_sha = host.open(&units).unwrap().sha256().to_owned();
    entries.insert("units".into(), json!({ "sha256": units_sha }));
    let next_policy = dir.path().join("policy.next.json");
    write_policy(&next_policy, &entries);
    let keys = dir.path().join("keys.json");
    std::fs::write(
        &keys,
        json!({"keys": [
            {"id": "admin", "sha256": thorn_tests::sha256_hex(b"adm1n")},
            {"id": "robot", "sha256": thorn_tests::sha256_hex(b"r0b0t"), "tools": ["calculator"]}]})
        .to_string(),
    )
    .unwrap();
    let path = path_str;
    let server = thorn_tests::ServeProcess::start(&[
        "--context",
        "1024",
        "--plugins",
        &path(&installed),
        "--policy",
        &path(&policy),
        "--api-keys",
        &path(&keys),
        "--plugin-poll",
        "1",
        "--max-body",
        "65536",
    ]);
    let url = format!("http://{}/mcp", server.addr);
    let out = thorn_tests::run_client(
        &python,
        "mcp_http.py",
        &[
            &url,
            "adm1n",
            "r0b0t",
            &path(&units),
            &path(&installed),
            &path(&next_policy),
            &path(&policy),
        ],
    );
    eprintln!("{out}\n--- server ---\n{}", server.log());

    // The guards in front of the protocol.
    for (case, status) in [
        ("no_key", 401),
        ("wrong_key", 401),
        ("evil_origin", 403),
        ("evil_host", 403),
        ("good_raw", 200),
        ("too_large", 413),
    ] {
        assert_eq!(out[case]["status"], status, "{case}: {}", out[case]);
    }
    assert!(
        out["evil_origin"]["body"]
            .as_str()
            .unwrap()
            .contains("Origin")
    );
    assert!(out["evil_host"]["body"].as_str().unwrap().contains("Host"));

    // A 2025-11-25 session with the full key: every tool, with its schemas and hints.
    assert_eq!(out["legacy_version"], "2025-11-25");
    let tools = out["tools"].as_object().unwrap();
    let mut names: Vec<&str> = tools.keys().map(String::as_str).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        ["evaluate", "list_files", "read_file", "search_files"]
    );
    assert_eq!(tools["read_file"]["annotations"]["readOnlyHint"], true);
    assert_eq!(out["call"]["structuredContent"]["value"], 51.0);
    assert_eq!(out["bad_arguments"]["isError"], true);
    assert!(
        out["unknown"]["error"]
            .as_str()
            .unwrap()
            .contains("no_such_tool"),
        "{}",
        out["unknown"]
    );

    // The robot's key sees and runs only the calculator.
    assert_eq!(out["robot_tools"], json!(["evaluate"]));
    let denied = out["robot_denied"]["error"].as_str().unwrap();
    assert!(
        denied.contains("robot") && denied.contains("read_file"),
        "{denied}"
    );
    assert_eq!(out["robot_call"]["structuredContent"]["value"], 1024.0);

    // Installing and approving a plugin reaches both kinds of client, and its tool is served.
    assert_eq!(out["modern_event"], "ToolsListChanged", "{out}");
    assert!(
        out["legacy_notes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n == "ToolListChangedNotification"),
        "{out}"
    );
    assert_eq!(
        out["tools_after"],
        json!([
            "convert",
            "evaluate",
            "list_files",
            "read_file",
            "search_files"
        ])
    );
    assert_eq!(
        out["robot_tools_after"],
        json!(["evaluate"]),
        "allow-lists hold for new tools"
    );
    assert_eq!(out["new_call"]["structuredContent"]["value"], 1000.0);
    // ... and to the chat API, which serves the same live set.
    let health = thorn_tests::http(server.addr, "GET", "/health", &[], b"").json();
    assert_eq!(health["plugins"], 3, "{health}");

    // Every call is audited under the key that made it, with the client's address.
    let log = std::fs::read_to_string(&audit).unwrap();
    let records: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let by = |key: &str, function: &str| {
        records.iter().any(|r| {
            r["key_id"] == key
                && r["function"] == function
                && r["phase"] == "intent"
                && r["peer"]
                    .as_str()
                    .is_some_and(|p| p.starts_with("127.0.0.1:"))
        })
    };
    assert!(by("admin", "evaluate") && by("admin", "convert"), "{log}");
    assert!(
        by("robot", "evaluate") && !by("robot", "read_file"),
        "{log}"
    );
}

/// An MCP `initialize` over HTTP to `/mcp` (with `key` as a bearer key): a new session.
fn initialize(addr: std::net::SocketAddr, key: Option<&str>) -> thorn_tests::HttpResponse {
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "raw", "version": "0"}}})
    .to_string();
    let bearer = key.map(|k| format!("Bearer {k}"));
    let mut headers = vec![
        ("Content-Type", "application/json"),
        ("Accept", "application/json, text/event-stream"),
    ];
    if let Some(b) = &bearer {
        headers.push(("Authorization", b.as_str()));
    }
    thorn_tests::http(addr, "POST", "/mcp", &headers, init.as_bytes())
}

/// `/mcp`'s session bound: with `--mcp-max-sessions 1` a second `initialize` is a 429 with
/// `Retry-After` while the first session lives, and is served once that session is closed (DELETE).
#[test]
fn mcp_sessions_are_bounded() {
    let Installed {
        plugins: installed,
        dir,
        entries,
        ..
    } = install(&["calculator"]);
    let policy = dir.path().join("policy.json");
    std::fs::write(&policy, json!({ "plugins": entries }).to_string()).unwrap();
    let server = thorn_tests::ServeProcess::start(&[
        "--context",
        "1024",
        "--plugins",
        &path_str(&installed),
        "--policy",
        &path_str(&policy),
        "--mcp-max-sessions",
        "1",
    ]);
    let open = || initialize(server.addr, None);
    let first = open();
    assert_eq!(first.status, 200, "{}\n{}", first.body, server.log());
    assert!(first.body.contains("\"serverInfo\""), "{}", first.body);
    let session = first
        .header("mcp-session-id")
        .expect("a 2025-11-25 session")
        .to_owned();
    let second = open();
    assert_eq!(second.status, 429, "{}", second.body);
    assert!(second.header("retry-after").is_some());
    assert!(second.body.contains("MCP sessions"), "{}", second.body);
    let closed = thorn_tests::http(
        server.addr,
        "DELETE",
        "/mcp",
        &[("Mcp-Session-Id", session.as_str())],
        b"",
    );
    assert!(closed.status < 300, "{} {}", closed.status, closed.body);
    // The session's worker ends asynchronously after the DELETE.
    let t0 = std::time::Instant::now();
    loop {
        let again = open();
        if again.status == 200 {
            break;
        }
        assert_eq!(again.status, 429, "{}", again.body);
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "the closed session still counts"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// One client cannot take every MCP session: with `--mcp-max-sessions-per-peer 2` a third `initialize`
/// from the same address is a 429 naming the bound, and with keys a key is bounded the same way
/// (`--mcp-max-sessions-per-key 1`) while another key still gets its session.
#[test]
fn mcp_sessions_are_bounded_per_key_and_per_address() {
    let Installed {
        plugins: installed,
        dir,
        entries,
        ..
    } = install(&["calculator"]);
    let policy = dir.path().join("policy.json");
    std::fs::write(&policy, json!({ "plugins": entries }).to_string()).unwrap();
    let open = initialize;
    // Per address.
    let server = thorn_tests::ServeProcess::start(&[
        "--context",
        "1024",
        "--plugins",
        &path_str(&installed),
        "--policy",
        &path_str(&policy),
        "--mcp-max-sessions-per-peer",
        "2",
    ]);
    for _ in 0..2 {
        let r = open(server.addr, None);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let third = open(server.addr, None);
    assert_eq!(third.status, 429, "{}", third.body);
    assert!(
        third.body.contains("this address has 2 MCP sessions"),
        "{}",
        third.body
    );
    assert!(third.header("retry-after").is_some());
    drop(server);
    // Per key.
    let server = thorn_tests::ServeProcess::start(&[
        "--context",
        "1024",
        "--plugins",
        &path_str(&installed),
        "--policy",
        &path_str(&policy),
        "--api-key",
        "sk-one",
        "--api-key",
        "sk-two",
        "--mcp-max-sessions-per-key",
        "1",
    ]);
    assert_eq!(open(server.addr, Some("sk-one")).status, 200);
    let again = open(server.addr, Some("sk-one"));
    assert_eq!(again.status, 429, "{}", again.body);
    assert!(
        again.body.contains("this API key has 1 MCP sessions"),
        "{}",
        again.body
    );
    assert_eq!(
        open(server.addr, Some("sk-two")).status,
        200,
        "another key is served"
    );
}
