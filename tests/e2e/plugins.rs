//! Real wasm plugins in the sandbox: the calculator, and every way the hostile plugin misbehaves. After each
//! hostile call the host must still serve a normal call.

use serde_json::json;
use std::sync::OnceLock;
use std::time::Duration;
use thorn::tools::plugin::{Limits, Plugin, PluginError, PluginHost};
use thorn_tests::plugin_wasm;

fn host() -> &'static PluginHost {
    static HOST: OnceLock<PluginHost> = OnceLock::new();
    HOST.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("thorn-test-cwasm-{}", std::process::id()));
        PluginHost::new(Some(dir)).unwrap()
    })
}

fn hostile() -> Plugin {
    let limits = Limits {
        timeout: Duration::from_millis(500),
        memory: 32 << 20,
        stdio: 16 << 10,
        max_output: 64 << 10,
        ..Limits::default()
    };
    host().load(&plugin_wasm("hostile"), limits).unwrap()
}

#[test]
fn calculator_describes_itself_and_evaluates() {
    let p = host()
        .load(&plugin_wasm("calculator"), Limits::default())
        .unwrap();
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
    assert!(
        matches!(err, PluginError::Tool(ref m) if m.contains("division by zero")),
        "{err}"
    );
    // Arguments that violate the schema never reach the plugin.
    let err = p.call("evaluate", &json!({"expr": "1"})).unwrap_err();
    assert!(matches!(err, PluginError::Arguments(_)), "{err}");
    let err = p.call("evaluate", &json!({"expression": ""})).unwrap_err();
    assert!(matches!(err, PluginError::Arguments(_)), "{err}");
    let err = p.call("nope", &json!({})).unwrap_err();
    assert!(matches!(err, PluginError::UnknownFunction { .. }), "{err}");
    // A second load comes from the .cwasm cache.
    let again = host()
        .load(&plugin_wasm("calculator"), Limits::default())
        .unwrap();
    assert_eq!(again.sha256(), p.sha256());
}

fn still_serves(p: &Plugin) {
    assert_eq!(p.call("ok", &json!({"n": 41})).unwrap(), json!(42));
}

#[test]
fn hostile_plugins_are_stopped_with_clear_errors() {
    let p = hostile();
    type Expect = fn(&PluginError) -> bool;
    let cases: Vec<(&str, serde_json::Value, Expect)> = vec![
        ("spin", json!({}), |e| {
            matches!(e, PluginError::Timeout { .. })
        }),
        ("sleep", json!({"n": 3000}), |e| {
            matches!(e, PluginError::Timeout { .. })
        }),
        ("alloc", json!({}), |e| {
            matches!(e, PluginError::MemoryLimit { .. })
        }),
        (
            "recurse",
            json!({}),
            |e| matches!(e, PluginError::Trap { trap, .. } if trap.contains("stack")),
        ),
        (
            "panic",
            json!({}),
            |e| matches!(e, PluginError::Trap { stderr, .. } if stderr.contains("panicked on purpose")),
        ),
        (
            "read",
            json!({"target": "/etc/passwd"}),
            |e| matches!(e, PluginError::Tool(m) if m.contains("cannot read")),
        ),
        (
            "read",
            json!({"target": "../../../../etc/passwd"}),
            |e| matches!(e, PluginError::Tool(m) if m.contains("cannot read")),
        ),
        (
            "connect",
            json!({"target": "127.0.0.1:9"}),
            |e| matches!(e, PluginError::Tool(m) if m.contains("cannot connect")),
        ),
        ("flood", json!({"n": 100_000_000}), |e| {
            matches!(e, PluginError::Tool(m) if m.contains("stdout"))
                || matches!(e, PluginError::Trap { .. })
        }),
        ("huge", json!({"n": 1_000_000}), |e| {
            matches!(e, PluginError::Output { .. })
        }),
    ];
    for (f, args, expected) in cases {
        let t = std::time::Instant::now();
        let err = p.call(f, &args).unwrap_err();
        eprintln!("{f}: {err} ({:?})", t.elapsed());
        assert!(expected(&err), "{f}: unexpected error {err:?}");
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "{f} took {:?}",
            t.elapsed()
        );
        still_serves(&p);
    }
}
