//! Write a thorn tool plugin as typed Rust functions.
//!
//! A plugin is a WASI preview 2 component exporting the `thorn:tool/tool` world (`plugins/sdk/wit/tool.wit`):
//! `describe()` returns the manifest and `call(function, args)` runs one function. This crate generates that
//! glue. The author writes functions over serde types that derive [`JsonSchema`]; the SDK derives each
//! function's `parameters` and `returns` schemas from those types (inlined, no `$ref`), builds the manifest,
//! and decodes and encodes the JSON on every call:
//!
//! ```ignore
//! use thorn_plugin_sdk::{JsonSchema, Plugin, Deserialize, Serialize};
//!
//! #[derive(Deserialize, JsonSchema)]
//! struct Add { /// First term.
//!     a: f64, /// Second term.
//!     b: f64 }
//!
//! fn add(x: Add) -> Result<f64, String> { Ok(x.a + x.b) }
//!
//! thorn_plugin_sdk::plugin!(Plugin::new("adder", "0.1.0", "Adds numbers").function("add", "Adds two numbers", add));
//! ```
//!
//! Build with `cargo build --release --target wasm32-wasip2`; the `.wasm` in `target/wasm32-wasip2/release/`
//! is the component the host loads.

pub use schemars::JsonSchema;
pub use serde::{Deserialize, Serialize, de::DeserializeOwned};
pub use serde_json::{Value, json};

#[doc(hidden)]
pub mod bindings {
    wit_bindgen::generate!({
        world: "tool",
        path: "wit",
        pub_export_macro: true,
        default_bindings_module: "thorn_plugin_sdk::bindings",
    });
}

type Handler = Box<dyn Fn(&str) -> Result<String, String> + Send + Sync>;

/// A schema, generated only when the manifest is asked for: every call runs in a fresh instance, so work
/// done while building the [`Plugin`] is paid on every call.
enum Schema {
    Of(fn() -> Value),
    Given(Value),
}

impl Schema {
    fn get(&self) -> Value {
        match self {
            Schema::Of(f) => f(),
            Schema::Given(v) => v.clone(),
        }
    }
}

/// One function of a plugin.
struct Function {
    name: String,
    description: String,
    parameters: Schema,
    returns: Schema,
    examples: Vec<Value>,
    answer: Option<String>,
    from_request: Vec<String>,
    annotations: serde_json::Map<String, Value>,
    stop: bool,
    deadman: Option<(u64, String)>,
    run: Handler,
}

/// A plugin: its identity, functions and the capabilities it asks for.
pub struct Plugin {
    name: String,
    version: String,
    description: String,
    functions: Vec<Function>,
    capabilities: serde_json::Map<String, Value>,
}

/// The JSON schema of `T`, inlined (no `$ref`/`$defs`) and without the `$schema`/`title` decoration.
pub fn schema_of<T: JsonSchema>() -> Value {
    let settings = schemars::generate::SchemaSettings::draft2020_12().with(|s| {
        s.inline_subschemas = true;
    });
    let schema = settings.into_generator().into_root_schema_for::<T>();
    let mut v = serde_json::to_value(schema).unwrap_or_else(|_| json!({}));
    if let Some(o) = v.as_object_mut() {
        o.remove("$schema");
        o.remove("title");
    }
    v
}

/// The parameters schema of a function taking `A`: [`schema_of`], with an object that declares no
/// properties closed (`additionalProperties: false`), so a function without arguments takes `{}` only and
/// a call with invented arguments is refused before it runs, whether or not the struct denies unknown
/// fields.
pub fn parameters_of<A: JsonSchema>() -> Value {
    let mut v = schema_of::<A>();
    if let Some(o) = v.as_object_mut() {
        let no_properties = o
            .get("properties")
            .is_none_or(|p| p.as_object().is_some_and(|p| p.is_empty()));
        if o.get("type") == Some(&json!("object"))
            && no_properties
            && !o.contains_key("additionalProperties")
        {
            o.insert("additionalProperties".into(), json!(false));
        }
    }
    v
}

impl Plugin {
    /// A plugin with no functions yet.
    pub fn new(name: &str, version: &str, description: &str) -> Self {
        Plugin {
            name: name.into(),
            version: version.into(),
            description: description.into(),
            functions: Vec::new(),
            capabilities: serde_json::Map::new(),
        }
    }

    /// Adds a function: `f` takes the decoded arguments and returns a result to encode, or an error message
    /// for the model.
    pub fn function<A, R, F>(mut self, name: &str, description: &str, f: F) -> Self
    where
        A: DeserializeOwned + JsonSchema,
        R: Serialize + JsonSchema,
        F: Fn(A) -> Result<R, String> + Send + Sync + 'static,
    {
        let run: Handler = Box::new(move |args: &str| {
            let a: A = serde_json::from_str(args).map_err(|e| format!("bad arguments: {e}"))?;
            let r = f(a)?;
            serde_json::to_string(&r).map_err(|e| format!("cannot encode the result: {e}"))
        });
        self.functions.push(Function {
            name: name.into(),
            description: description.into(),
            parameters: Schema::Of(parameters_of::<A>),
            returns: Schema::Of(schema_of::<R>),
            examples: Vec::new(),
            answer: None,
            from_request: Vec::new(),
            annotations: serde_json::Map::new(),
            stop: false,
            deadman: None,
            run,
        });
        self
    }

    /// Adds a function that takes the arguments as JSON text and returns JSON text itself, with a schema
    /// written by hand: for authors who want their own encoding. The host still validates the arguments
    /// against `parameters` and the result as JSON.
    pub fn raw_function<F>(mut self, name: &str, description: &str, parameters: Value, f: F) -> Self
    where
        F: Fn(&str) -> Result<String, String> + Send + Sync + 'static,
    {
        self.functions.push(Function {
            name: name.into(),
            description: description.into(),
            parameters: Schema::Given(parameters),
            returns: Schema::Given(Value::Bool(true)),
            examples: Vec::new(),
            answer: None,
            from_request: Vec::new(),
            annotations: serde_json::Map::new(),
            stop: false,
            deadman: None,
            run: Box::new(f),
        });
        self
    }

    /// Adds an example to the function added last: a request a user might make and the arguments it maps
    /// to. The host checks each against the function's parameters, shows them to a model as earlier turns
    /// of the conversation, and its tool router reads their words. A few varied ones help a small model
    /// most (at most 8).
    pub fn example(mut self, request: &str, arguments: Value) -> Self {
        if let Some(f) = self.functions.last_mut() {
            f.examples
                .push(json!({"request": request, "arguments": arguments}));
        }
        self
    }

    /// Names string parameters of the function added last whose value the user's request spells out (a
    /// key, a file name, a search term): when the host's agent routed the call, each is decoded as one of
    /// the request's own word spans, so a small model copies it rather than inventing one.
    pub fn from_request(mut self, params: &[&str]) -> Self {
        if let Some(f) = self.functions.last_mut() {
            f.from_request = params.iter().map(|p| (*p).to_owned()).collect();
        }
        self
    }

    /// Marks the function added last as changing nothing (MCP `readOnlyHint`; also idempotent and not
    /// destructive). Hints for clients: the host's policy is what limits a plugin.
    pub fn read_only(mut self) -> Self {
        for (k, v) in [
            ("readOnlyHint", true),
            ("destructiveHint", false),
            ("idempotentHint", true),
        ] {
            self.hint(k, v);
        }
        self
    }

    /// Marks the function added last as one that may change or destroy something irreversibly (MCP
    /// `destructiveHint`), and whether calling it again with the same arguments does nothing more
    /// (`idempotentHint`).
    pub fn destructive(mut self, idempotent: bool) -> Self {
        for (k, v) in [
            ("readOnlyHint", false),
            ("destructiveHint", true),
            ("idempotentHint", idempotent),
        ] {
            self.hint(k, v);
        }
        self
    }

    /// Marks the function added last as one that makes the actuator safe (a stop, a return home): the
    /// host always runs it, the e-stop latched included. A promise the host relies on, unlike the hints:
    /// mark only functions that stop or park.
    pub fn stop(mut self) -> Self {
        if let Some(f) = self.functions.last_mut() {
            f.stop = true;
        }
        self
    }

    /// Declares the function added last a motion that lasts as long as its call runs (a jog, a timed
    /// move), at most `max_ms`, stopped by `stop` (a function of this plugin marked [`Plugin::stop`],
    /// taking no arguments). The host calls `stop` whenever the motion ends any way but finishing: it
    /// runs too long, times out or fails, its request is cancelled or its client goes away, or the
    /// e-stop latches.
    pub fn deadman(mut self, max_ms: u64, stop: &str) -> Self {
        if let Some(f) = self.functions.last_mut() {
            f.deadman = Some((max_ms, stop.to_owned()));
        }
        self
    }

    fn hint(&mut self, key: &str, on: bool) {
        if let Some(f) = self.functions.last_mut() {
            f.annotations.insert(key.into(), Value::Bool(on));
        }
    }

    /// Sets how a result of the function added last reads as an answer: a Jinja template over `arguments`
    /// and `result`, e.g. `{{ arguments.expression }} = {{ result.value | num }}`. When the host's agent
    /// routed the call, the rendered text is its answer, exactly as the function computed it.
    pub fn answer(mut self, template: &str) -> Self {
        if let Some(f) = self.functions.last_mut() {
            f.answer = Some(template.into());
        }
        self
    }

    /// Asks for a directory (`access` is `"read"` or `"read-write"`); the operator's policy decides.
    pub fn wants_dir(mut self, path: &str, access: &str) -> Self {
        self.push_capability("filesystem", json!({"path": path, "access": access}));
        self
    }

    /// Asks for an environment variable; the operator's policy decides whether and with what value.
    pub fn wants_env(mut self, name: &str) -> Self {
        self.push_capability("env", json!(name));
        self
    }

    /// Asks to open TCP connections to `host:port` (`port` may be `*`); denied unless the policy grants it.
    pub fn wants_network(mut self, host_port: &str) -> Self {
        self.push_capability("network", json!(host_port));
        self
    }

    fn push_capability(&mut self, kind: &str, v: Value) {
        let list = self.capabilities.entry(kind).or_insert_with(|| json!([]));
        if let Some(a) = list.as_array_mut() {
            a.push(v);
        }
    }

    /// The manifest JSON that `describe()` returns.
    pub fn manifest(&self) -> String {
        let functions: Vec<Value> = self
            .functions
            .iter()
            .map(|f| {
                let mut v = json!({"name": f.name, "description": f.description,
                    "parameters": f.parameters.get(), "returns": f.returns.get()});
                if !f.examples.is_empty() {
                    v["examples"] = Value::Array(f.examples.clone());
                }
                if let Some(a) = &f.answer {
                    v["answer"] = json!(a);
                }
                if !f.from_request.is_empty() {
                    v["from_request"] = json!(f.from_request);
                }
                if !f.annotations.is_empty() {
                    v["annotations"] = Value::Object(f.annotations.clone());
                }
                if f.stop {
                    v["stop"] = json!(true);
                }
                if let Some((max_ms, stop)) = &f.deadman {
                    v["deadman"] = json!({"max_ms": max_ms, "stop": stop});
                }
                v
            })
            .collect();
        json!({
            "name": self.name,
            "version": self.version,
            "description": self.description,
            "functions": functions,
            "capabilities": self.capabilities,
        })
        .to_string()
    }

    /// Runs `function` on `args`.
    pub fn call(&self, function: &str, args: &str) -> Result<String, String> {
        let f = self
            .functions
            .iter()
            .find(|f| f.name == function)
            .ok_or_else(|| format!("no function {function:?} in plugin {:?}", self.name))?;
        (f.run)(args)
    }
}

/// Exports `plugin` (an expression building a [`Plugin`]) as the component's `thorn:tool/tool` world. The
/// plugin is built once per instance.
#[macro_export]
macro_rules! plugin {
    ($build:expr) => {
        struct __ThornPlugin;

        fn __thorn_plugin() -> &'static $crate::Plugin {
            static P: ::std::sync::OnceLock<$crate::Plugin> = ::std::sync::OnceLock::new();
            P.get_or_init(|| $build)
        }

        impl $crate::bindings::Guest for __ThornPlugin {
            fn describe() -> ::std::string::String {
                __thorn_plugin().manifest()
            }

            fn call(
                function: ::std::string::String,
                args: ::std::string::String,
            ) -> ::std::result::Result<::std::string::String, ::std::string::String> {
                __thorn_plugin().call(&function, &args)
            }
        }

        $crate::bindings::export!(__ThornPlugin);
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    /// No arguments, as an author writes it without `deny_unknown_fields`.
    #[derive(Deserialize, JsonSchema)]
    struct Nothing {}

    #[derive(Deserialize, JsonSchema)]
    #[allow(dead_code)]
    struct Roll {
        sides: u32,
    }

    #[test]
    fn a_function_without_arguments_takes_an_empty_object_only() {
        let p = parameters_of::<Nothing>();
        assert_eq!(p["type"], "object", "{p}");
        assert_eq!(p["additionalProperties"], false, "{p}");
        // A struct with fields keeps its schema as derived.
        let r = parameters_of::<Roll>();
        assert_eq!(r, schema_of::<Roll>());
        assert!(r.get("additionalProperties").is_none(), "{r}");
    }
}
