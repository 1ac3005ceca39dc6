//! What a plugin says about itself: the manifest its `describe()` returns (validated against
//! `schemas/tool-manifest.schema.json`), its functions and their hints, the per-call limits a policy grants,
//! and the checks of a manifest's examples against its schemas.

use crate::PluginError;
use serde_json::Value;
use std::time::Duration;
use thorn_tools::ToolSet;

/// The manifest schema every plugin's `describe()` must satisfy.
pub const MANIFEST_SCHEMA: &str = include_str!("../../../schemas/tool-manifest.schema.json");

/// Per-call limits (the operator's policy sets them per plugin).
#[derive(Debug, Clone)]
pub struct Limits {
    /// Wall-clock limit of one call.
    pub timeout: Duration,
    /// Linear-memory cap in bytes, over all of an instance's memories together.
    pub memory: usize,
    /// Fuel budget (`None` = unmetered; epochs still bound the time).
    pub fuel: Option<u64>,
    /// Bytes of stdout and of stderr kept (beyond it the guest's writes fail).
    pub stdio: usize,
    /// Largest result accepted, in bytes; a longer error message from the tool is cut to it.
    pub max_output: usize,
    /// Resource-table entries (open files, directories, sockets, streams, ...) a call may hold at once.
    pub max_resources: usize,
    /// Calls of this plugin that may run at once (more wait, within their time limit).
    pub max_concurrent: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            timeout: Duration::from_secs(5),
            memory: 64 << 20,
            fuel: None,
            stdio: 64 << 10,
            max_output: 1 << 20,
            max_resources: 256,
            max_concurrent: 16,
        }
    }
}

/// One function a plugin exports.
#[derive(Debug, Clone)]
pub struct FunctionDef {
    /// Its name inside the plugin.
    pub name: String,
    /// What it does.
    pub description: String,
    /// JSON schema of its arguments.
    pub parameters: Value,
    /// JSON schema of its result, if declared.
    pub returns: Option<Value>,
    /// Example requests and their arguments (each valid against `parameters`).
    pub examples: Vec<thorn_tools::Example>,
    /// How a result reads as an answer.
    pub answer: Option<thorn_tools::AnswerTemplate>,
    /// String parameters whose value the request spells out (each a top-level `"type": "string"`
    /// property of `parameters`).
    pub from_request: Vec<String>,
    /// What a call does, as hints for clients (MCP tool annotations).
    pub annotations: Annotations,
    /// It makes an actuator safe (`"stop": true`): it always runs, the e-stop latched included.
    pub stop: bool,
    /// A call of it is a motion that lasts as long as the call runs, at most this long; the host ends
    /// it and calls the stop named here when it runs past that, fails, or is abandoned.
    pub deadman: Option<crate::deadman::Deadman>,
}

/// A function's MCP tool annotations: hints for clients (an agent asking a person before a destructive
/// call), never what the host enforces (the policy is).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Annotations {
    /// `readOnlyHint`: it changes nothing.
    pub read_only: Option<bool>,
    /// `destructiveHint`: it may change or destroy something irreversibly.
    pub destructive: Option<bool>,
    /// `idempotentHint`: calling it again with the same arguments does nothing more.
    pub idempotent: Option<bool>,
    /// `openWorldHint`: it reaches outside the host.
    pub open_world: Option<bool>,
}

impl Annotations {
    /// From a manifest's `annotations` object (already validated against the manifest schema).
    pub fn from_manifest(v: &Value) -> Self {
        let hint = |k: &str| v.get(k).and_then(Value::as_bool);
        Annotations {
            read_only: hint("readOnlyHint"),
            destructive: hint("destructiveHint"),
            idempotent: hint("idempotentHint"),
            open_world: hint("openWorldHint"),
        }
    }

    /// Whether any hint is given.
    pub fn is_empty(&self) -> bool {
        *self == Annotations::default()
    }
}

/// A validated manifest.
#[derive(Debug, Clone)]
pub struct Manifest {
    /// Plugin name.
    pub name: String,
    /// Plugin version.
    pub version: String,
    /// What it is for.
    pub description: String,
    /// Its functions.
    pub functions: Vec<FunctionDef>,
    /// What it asks for.
    pub capabilities: Value,
}

/// Reads the manifest `text` a plugin's `describe()` returned (`path` names the plugin in errors),
/// checked against `validator` (the compiled [`MANIFEST_SCHEMA`]).
pub(crate) fn parse(
    validator: &jsonschema::Validator,
    path: &str,
    text: &str,
) -> Result<Manifest, PluginError> {
    let bad = |msg: String| PluginError::Manifest {
        path: path.to_owned(),
        msg,
    };
    let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let errors: Vec<String> = validator
        .iter_errors(&v)
        .map(|e| format!("{e} at {}", e.instance_path()))
        .collect();
    if !errors.is_empty() {
        return Err(bad(errors.join("; ")));
    }
    let s = |k: &str| v[k].as_str().unwrap_or("").to_owned();
    let mut functions = Vec::new();
    for f in v["functions"].as_array().into_iter().flatten() {
        let name = f["name"].as_str().unwrap_or("").to_owned();
        let examples = f["examples"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| thorn_tools::Example {
                request: e["request"].as_str().unwrap_or("").to_owned(),
                arguments: e["arguments"].clone(),
            })
            .collect();
        let answer = match f["answer"].as_str() {
            Some(src) => Some(
                thorn_tools::AnswerTemplate::new(src)
                    .map_err(|e| bad(format!("function {name:?}: {e}")))?,
            ),
            None => None,
        };
        let from_request: Vec<String> = f["from_request"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p.as_str().map(str::to_owned))
            .collect();
        functions.push(FunctionDef {
            annotations: Annotations::from_manifest(&f["annotations"]),
            stop: f["stop"].as_bool().unwrap_or(false),
            deadman: f.get("deadman").map(|d| crate::deadman::Deadman {
                max: std::time::Duration::from_millis(d["max_ms"].as_u64().unwrap_or(0)),
                stop: d["stop"].as_str().unwrap_or("").to_owned(),
            }),
            from_request,
            description: f["description"].as_str().unwrap_or("").to_owned(),
            parameters: f["parameters"].clone(),
            returns: f.get("returns").cloned(),
            examples,
            answer,
            name,
        });
    }
    Ok(Manifest {
        name: s("name"),
        version: s("version"),
        description: s("description"),
        functions,
        capabilities: v.get("capabilities").cloned().unwrap_or(Value::Null),
    })
}

/// A host function as a tool-set (OpenAI `tools`) definition.
pub(crate) fn tool_definition(f: &FunctionDef) -> Value {
    serde_json::json!({"type": "function", "function": {"name": f.name,
        "description": f.description, "parameters": f.parameters}})
}

/// Checks what a manifest says about using its functions against their schemas: every example must be a
/// call the model could make (it is shown to the model as one), and `from_request` may name only string
/// parameters.
pub(crate) fn check_usage(manifest: &Manifest, tools: &ToolSet) -> Result<(), String> {
    for f in &manifest.functions {
        for (i, e) in f.examples.iter().enumerate() {
            let call = thorn_tools::ParsedCall {
                name: f.name.clone(),
                arguments: e.arguments.clone(),
            };
            tools.check(&call).map_err(|err| {
                format!(
                    "function {:?}: example {i} does not fit its parameters: {err}",
                    f.name
                )
            })?;
        }
        if let Some(d) = &f.deadman {
            let stop = manifest.functions.iter().find(|s| s.name == d.stop);
            let ok = stop.is_some_and(|s| {
                s.stop
                    && tools
                        .check(&thorn_tools::ParsedCall {
                            name: s.name.clone(),
                            arguments: Value::Object(Default::default()),
                        })
                        .is_ok()
            });
            if !ok {
                return Err(format!(
                    "function {:?}: its deadman stop {:?} must be a function of this plugin marked \"stop\": true that takes no arguments",
                    f.name, d.stop
                ));
            }
        }
        if let Some(p) = f
            .from_request
            .iter()
            .find(|p| f.parameters["properties"][p.as_str()]["type"] != "string")
        {
            return Err(format!(
                "function {:?}: from_request names {p:?}, which is not a string parameter",
                f.name
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod usage_tests {
    use super::*;
    use serde_json::json;

    fn manifest(examples: Vec<thorn_tools::Example>, from_request: &[&str]) -> (Manifest, ToolSet) {
        let parameters = json!({"type": "object", "properties": {"key": {"type": "string"},
            "n": {"type": "integer"}}, "required": ["key"], "additionalProperties": false});
        let tools = ToolSet::new(&[json!({"type": "function", "function": {"name": "f",
            "description": "", "parameters": parameters}})])
        .unwrap();
        let m = Manifest {
            name: "p".into(),
            version: "1".into(),
            description: String::new(),
            functions: vec![FunctionDef {
                name: "f".into(),
                description: String::new(),
                parameters,
                returns: None,
                examples,
                answer: None,
                from_request: from_request.iter().map(|s| (*s).to_owned()).collect(),
                annotations: Annotations::default(),
                stop: false,
                deadman: None,
            }],
            capabilities: Value::Null,
        };
        (m, tools)
    }

    fn example(arguments: Value) -> thorn_tools::Example {
        thorn_tools::Example {
            request: "r".into(),
            arguments,
        }
    }

    #[test]
    fn examples_must_fit_the_schema_and_from_request_names_strings() {
        let (m, t) = manifest(vec![example(json!({"key": "a", "n": 1}))], &["key"]);
        assert_eq!(check_usage(&m, &t), Ok(()));
        let (m, t) = manifest(vec![example(json!({"n": 1}))], &[]);
        let e = check_usage(&m, &t).unwrap_err();
        assert!(e.contains("example 0 does not fit"), "{e}");
        let (m, t) = manifest(vec![], &["n"]);
        assert!(
            check_usage(&m, &t)
                .unwrap_err()
                .contains("not a string parameter")
        );
        let (m, t) = manifest(vec![], &["absent"]);
        assert!(check_usage(&m, &t).is_err());
    }
}
