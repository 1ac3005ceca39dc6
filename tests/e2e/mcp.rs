//! thorn as an MCP server, driven by the MCP Python SDK (`tests/clients/mcp_stdio.py`, pinned in
//! `tests/clients/requirements.txt`): `thorn mcp` started as a child process over stdio, as a desktop agent
//! starts its tools. The calculator and the hostile plugin are installed with a policy; the client lists
//! the tools, calls one, makes a schema violation, hits a plugin timeout and an unknown tool, and then
//! calls again.

use serde_json::{Value, json};
use thorn_plugin::{HostConfig, PluginHost};

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
