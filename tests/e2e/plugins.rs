//! Real wasm plugins in the sandbox, built by tests/build.rs: every example tool here; every way the hostile
//! plugin misbehaves in `escapes` (after each, a normal call must still succeed); the operator's policy
//! (pins, grants, refusals), the audit log, the concurrency limits, the e-stop and rates in `policy`.

use serde_json::{Value, json};
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use thorn_plugin::{
    AuditLog, Caller, Grant, HostConfig, Limits, NetRule, Plugin, PluginError, PluginHost,
    PluginSet, Policy, PolicyError, Preopen, sha256_hex,
};
use thorn_tests::plugin_wasm;

mod author;
mod escapes;
mod keyless;
mod manage;
mod policy;
mod registry;

fn host() -> &'static PluginHost {
    static HOST: OnceLock<PluginHost> = OnceLock::new();
    HOST.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("thorn-test-cwasm-{}", std::process::id()));
        PluginHost::with_config(HostConfig {
            cache_dir: Some(dir),
            pool_slots: 32,
            max_memory: 256 << 20,
        })
        .unwrap()
    })
}

fn plain(name: &str) -> Plugin {
    host()
        .load_with(&plugin_wasm(name), Grant::none(Limits::default()))
        .unwrap()
}

fn dir_grant(host_dir: &Path, guest: &str, write: bool) -> Grant {
    Grant {
        preopens: vec![Preopen {
            host: host_dir.to_owned(),
            guest: guest.into(),
            write,
        }],
        ..Grant::none(Limits::default())
    }
}

fn tool_error(e: &PluginError, needle: &str) -> bool {
    matches!(e, PluginError::Tool(m) if m.contains(needle))
}

#[test]
fn calculator_describes_itself_and_evaluates() {
    let p = plain("calculator");
    assert_eq!(p.name(), "calculator");
    let m = p.manifest();
    assert_eq!(m.functions.len(), 1);
    assert_eq!(m.functions[0].name, "evaluate");
    assert_eq!(
        m.functions[0].parameters["properties"]["expression"]["type"],
        "string"
    );
    let out = p
        .call(
            "evaluate",
            &json!({"expression": "2 * (3 + 4) ^ 2 / sqrt(16)"}),
        )
        .unwrap();
    assert_eq!(out, json!({"value": 24.5}));
    // The tool's own error reaches the caller as text for the model.
    let err = p
        .call("evaluate", &json!({"expression": "1/0"}))
        .unwrap_err();
    assert!(tool_error(&err, "division by zero"), "{err}");
    // Arguments that violate the schema never reach the plugin.
    let err = p.call("evaluate", &json!({"expr": "1"})).unwrap_err();
    assert!(matches!(err, PluginError::Arguments(_)), "{err}");
    let err = p.call("evaluate", &json!({"expression": ""})).unwrap_err();
    assert!(matches!(err, PluginError::Arguments(_)), "{err}");
    let err = p.call("nope", &json!({})).unwrap_err();
    assert!(matches!(err, PluginError::UnknownFunction { .. }), "{err}");
    // A second load comes from the .cwasm cache.
    let again = plain("calculator");
    assert_eq!(again.sha256(), p.sha256());
    assert!(p.ping().is_ok());
}

#[test]
fn units_converts_and_its_schema_lists_the_units() {
    let p = plain("units");
    let out = p
        .call("convert", &json!({"value": 100, "from": "C", "to": "F"}))
        .unwrap();
    assert_eq!(
        out,
        json!({"value": 212.0, "unit": "F", "quantity": "temperature"})
    );
    let out = p
        .call("convert", &json!({"value": 3, "from": "mi", "to": "km"}))
        .unwrap();
    assert_eq!(out["value"], 4.828032);
    // Units as people write them, which a small model copies from the request.
    let out = p
        .call(
            "convert",
            &json!({"value": 6, "from": "feet", "to": "Meters"}),
        )
        .unwrap();
    assert_eq!(out["value"], 1.8288);
    let err = p
        .call("convert", &json!({"value": 1, "from": "kg", "to": "m"}))
        .unwrap_err();
    assert!(tool_error(&err, "cannot convert"), "{err}");
    // An unknown unit is the tool's error, naming the units it knows.
    let err = p
        .call(
            "convert",
            &json!({"value": 1, "from": "furlong", "to": "m"}),
        )
        .unwrap_err();
    assert!(tool_error(&err, "unknown unit"), "{err}");
    assert!(tool_error(&err, "kWh"), "{err}");
    // The schema is a string; the description gives every symbol with its name.
    let f = &p.manifest().functions[0];
    assert_eq!(f.parameters["properties"]["to"]["type"], "string");
    assert!(
        f.description.contains("kWh = kilowatt hour"),
        "{}",
        f.description
    );
    assert_eq!(f.from_request, ["from", "to"]);
}

#[test]
fn files_reads_and_searches_only_its_granted_directory() {
    let root = tempfile::tempdir().unwrap();
    let docs = root.path().join("docs");
    std::fs::create_dir_all(docs.join("notes")).unwrap();
    std::fs::write(docs.join("readme.md"), "# Thorn\nagent host\n").unwrap();
    std::fs::write(docs.join("notes/todo.txt"), "ship the Agent loop\nbench\n").unwrap();
    std::fs::write(root.path().join("secret.txt"), "outside the grant").unwrap();
    let p = host()
        .load_with(&plugin_wasm("files"), dir_grant(&docs, "/data", false))
        .unwrap();
    let list = p.call("list_files", &json!({})).unwrap();
    assert_eq!(
        list,
        json!([{"name": "notes", "kind": "dir", "size": 0},
               {"name": "readme.md", "kind": "file", "size": 19}])
    );
    let text = p
        .call(
            "read_file",
            &json!({"path": "notes/todo.txt", "max_bytes": 4}),
        )
        .unwrap();
    assert_eq!(text["content"], "ship");
    assert_eq!(text["truncated"], true);
    let hits = p.call("search_files", &json!({"query": "AGENT"})).unwrap();
    assert_eq!(
        hits["matches"],
        json!([{"path": "notes/todo.txt", "line": 1, "text": "ship the Agent loop"},
               {"path": "readme.md", "line": 2, "text": "agent host"}])
    );
    let err = p
        .call("read_file", &json!({"path": "../secret.txt"}))
        .unwrap_err();
    assert!(tool_error(&err, "not allowed"), "{err}");
    // The grant is read-only, and the manifest says so: a read-write grant is not handed out either.
    assert!(!p.grant().preopens[0].write);
}

#[test]
fn memory_persists_across_fresh_instances() {
    let dir = tempfile::tempdir().unwrap();
    let p = host()
        .load_with(
            &plugin_wasm("memory"),
            dir_grant(dir.path(), "/memory", true),
        )
        .unwrap();
    p.call("remember", &json!({"key": "user/name", "value": "Ada"}))
        .unwrap();
    p.call("remember", &json!({"key": "user/tea", "value": "green"}))
        .unwrap();
    p.call("remember", &json!({"key": "other", "value": "x"}))
        .unwrap();
    // Every call is a new instance: the notes live in the granted directory.
    assert_eq!(
        p.call("recall", &json!({"key": "user/name"})).unwrap(),
        json!({"key": "user/name", "value": "Ada"})
    );
    assert_eq!(
        p.call("list_keys", &json!({"prefix": "user/"})).unwrap(),
        json!(["user/name", "user/tea"])
    );
    assert_eq!(
        p.call("forget", &json!({"key": "user/tea"})).unwrap(),
        json!(true)
    );
    assert_eq!(
        p.call("recall", &json!({"key": "user/tea"})).unwrap()["value"],
        Value::Null
    );
    // With only a read-only mount, writes fail inside the sandbox.
    let ro = host()
        .load_with(
            &plugin_wasm("memory"),
            dir_grant(dir.path(), "/memory", false),
        )
        .unwrap();
    let err = ro
        .call("remember", &json!({"key": "k", "value": "v"}))
        .unwrap_err();
    assert!(tool_error(&err, "cannot store"), "{err}");
    assert_eq!(
        ro.call("recall", &json!({"key": "user/name"})).unwrap()["value"],
        "Ada"
    );
}

#[test]
fn robot_arm_enforces_limits_and_keeps_its_pose() {
    let dir = tempfile::tempdir().unwrap();
    let p = host()
        .load_with(
            &plugin_wasm("robot_arm"),
            dir_grant(dir.path(), "/state", true),
        )
        .unwrap();
    let s = p.call("arm_state", &json!({})).unwrap();
    assert_eq!(s["tool"], json!([0.28, 0.0, 0.35]));
    // Out of the joint's range: rejected by the schema before the plugin runs.
    let params = &p.manifest().functions[0].parameters;
    assert_eq!(params["properties"]["elbow"]["maximum"], 150.0);
    let err = p.call("move_joints", &json!({"shoulder": 95})).unwrap_err();
    assert!(matches!(err, PluginError::Arguments(_)), "{err}");
    // In range but into the table: refused by the plugin, pose unchanged.
    let err = p
        .call("move_joints", &json!({"shoulder": 90, "elbow": 90}))
        .unwrap_err();
    assert!(tool_error(&err, "below the table"), "{err}");
    let s = p
        .call(
            "move_joints",
            &json!({"base": 90, "shoulder": 30, "gripper": 10, "speed": 100}),
        )
        .unwrap();
    assert_eq!(s["base"], 90.0);
    assert_eq!(s["gripper"], 10.0);
    assert_eq!(s["motion_seconds"], 1.0);
    // The pose survives into the next (fresh) instance.
    let s = p.call("arm_state", &json!({})).unwrap();
    assert_eq!(
        (s["shoulder"].clone(), s["tool"][0].clone()),
        (json!(30.0), json!(0.0))
    );
    let s = p.call("arm_home", &json!({})).unwrap();
    assert_eq!(s["tool"], json!([0.28, 0.0, 0.35]));
}

#[test]
fn plugins_route_reproduces_a_requests_subset() {
    let dir = tempfile::tempdir().unwrap();
    let (plugins, policy) = (dir.path().join("plugins"), dir.path().join("policy.json"));
    let thorn = |args: &[&str]| {
        let out = std::process::Command::new(thorn_tests::thorn_binary())
            .arg("plugins")
            .args(args)
            .arg("--plugins")
            .arg(&plugins)
            .arg("--policy")
            .arg(&policy)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    };
    for p in ["calculator", "units"] {
        let (ok, text) = thorn(&["install", plugin_wasm(p).to_str().unwrap(), "--approve"]);
        assert!(ok, "{text}");
    }
    let msg = "Convert 10 km to miles";
    let (ok, full) = thorn(&["route", msg]);
    assert!(ok, "{full}");
    let (ok, only) = thorn(&["route", msg, "--tools", "thorn:units"]);
    assert!(ok, "{only}");
    // The same line for the function in both: the same score and coverage, routed in both.
    let line = |text: &str| {
        text.lines()
            .find(|l| l.contains(" convert "))
            .map(str::to_owned)
            .unwrap_or_else(|| panic!("no convert line: {text}"))
    };
    assert_eq!(line(&full), line(&only));
    assert!(line(&only).trim_start().starts_with('*'), "{only}");
    assert!(
        !only.contains("evaluate"),
        "only the units functions: {only}"
    );
    let (ok, err) = thorn(&["route", msg, "--tools", "dice"]);
    assert!(!ok);
    assert!(
        err.contains("no installed plugin or plugin function is called \"dice\""),
        "{err}"
    );
}
