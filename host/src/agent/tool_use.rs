//! How the agent puts host tools in front of a small model: routing, examples, answers from results.
//!
//! Measured on the default model (SmolLM2-135M, `thorn bench tasks`, BENCHMARKS.md "Tool use out of the
//! box"): offered all twelve example functions with `tool_choice: auto` it calls none; forced, it calls
//! one for every message; given the right plugin it still passes wrong arguments and misstates results.
//! So for a request whose tools are all host tools, with `tool_choice: auto` and the user speaking last:
//! 1. **Routing** ([`Routing::Lexical`]): [`thorn_tools::Router`] scores the functions against the user's
//!    message. None passes: the round is generated with no tools (an answer, never a call). Some pass:
//!    only those are shown, and a call is forced (the function named when there is one).
//!    A shown function's `from_request` parameters are decoded as word spans of the message
//!    ([`thorn_tools::quote_from_request`]), and the routed round is greedy, without repetition
//!    penalties: its arguments are read off the request.
//! 2. **Examples** (`examples`): the manifest's examples of the shown functions go into the prompt as
//!    earlier turns, a request and its call each, after the system message (at most
//!    [`MAX_EXAMPLE_TURNS`], only when at most [`MAX_EXAMPLE_FUNCTIONS`] functions are shown).
//! 3. **Answers** ([`Answers::Template`]): when a routed round's host calls all succeed and their
//!    functions declare an answer template, the rendered templates are the answer and no further round
//!    is generated. Otherwise the model answers from the results, with the tools off.
//!
//! A request opts out with `thorn_tool_use` (`{"routing": "off", "examples": false, "answers": "model"}`),
//! the server with `--tool-routing`, `--tool-examples`, `--tool-answers`. Client tools, other choices and
//! conversations that end with a tool result are served as the client asked.

use super::{HostCall, Turn};
use std::sync::Arc;
use thorn_plugin::PluginSet;
use thorn_tools::chat::{FunctionCall, Message, Role, ToolCall};
use thorn_tools::{RouteConfig, RouteDoc, Router, ToolChoice, ToolError, ToolSet};

/// Most example turns put into one prompt.
pub const MAX_EXAMPLE_TURNS: usize = 8;
/// Examples are shown only when at most this many functions are.
pub const MAX_EXAMPLE_FUNCTIONS: usize = 3;

/// Whether the router decides which host tools the model sees (`"off"`, `"lexical"` on the wire and the
/// command line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing {
    /// The model sees every requested tool and decides.
    Off,
    /// Lexical retrieval over the tools' own words ([`thorn_tools::route`]).
    Lexical,
}

/// Who words the answer after a routed call (`"model"`, `"template"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answers {
    /// The model, from the results.
    Model,
    /// The function's answer template, where it has one (else the model).
    Template,
}

/// How the agent uses host tools (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToolUse {
    /// Routing.
    pub routing: Routing,
    /// Show the manifests' examples.
    pub examples: bool,
    /// Answers after a routed call.
    pub answers: Answers,
}

impl Default for ToolUse {
    fn default() -> Self {
        ToolUse {
            routing: Routing::Lexical,
            examples: true,
            answers: Answers::Template,
        }
    }
}

impl std::str::FromStr for Routing {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(Routing::Off),
            "lexical" => Ok(Routing::Lexical),
            _ => Err(format!("{s:?}: routing is off or lexical")),
        }
    }
}

impl std::str::FromStr for Answers {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "model" => Ok(Answers::Model),
            "template" => Ok(Answers::Template),
            _ => Err(format!("{s:?}: answers are model or template")),
        }
    }
}

/// The first round of a turn, as tool use shapes it.
#[derive(Debug)]
pub(super) struct Plan {
    /// The tools shown (a routed subset, or all of the request's).
    pub shown: Arc<ToolSet>,
    /// The first round's choice.
    pub choice: ToolChoice,
    /// The functions the router offered (`Some(empty)`: none, so no tools); `None`: no routing applied.
    pub routed: Option<Vec<String>>,
    /// Example turns to put after the system message.
    pub examples: Vec<Message>,
}

impl Plan {
    /// The request as it asked: every tool shown, its own choice, no examples.
    pub(super) fn as_asked(all: &Arc<ToolSet>, turn: &Turn) -> Self {
        Plan {
            shown: Arc::clone(all),
            choice: turn.tool_choice.clone(),
            routed: None,
            examples: Vec::new(),
        }
    }
}

/// Plans the first round of `turn` over `all` (its tools) under `policy`.
pub(super) fn plan(
    plugins: &PluginSet,
    all: &Arc<ToolSet>,
    turn: &Turn,
    policy: ToolUse,
) -> Result<Plan, ToolError> {
    let mut plan = Plan {
        shown: Arc::clone(all),
        choice: turn.tool_choice.clone(),
        routed: None,
        examples: Vec::new(),
    };
    let host_only = !all.is_empty()
        && all
            .tools()
            .iter()
            .all(|t| turn.host_tools.contains(&t.name));
    let user_last = turn.messages.last().filter(|m| m.role == Role::User);
    if let (Routing::Lexical, true, ToolChoice::Auto, Some(user)) =
        (policy.routing, host_only, &turn.tool_choice, user_last)
    {
        // Scored among every installed function, so routing is a property of the message and the
        // function, not of what else this request offers.
        let installed = plugins.tools();
        let router = router_for(plugins, installed);
        let names: Vec<String> = router
            .route_among(&user.content, &RouteConfig::default(), |i| {
                all.get(&installed.tools()[i].name).is_some()
            })
            .iter()
            .map(|r| installed.tools()[r.index].name.clone())
            .collect();
        plan.choice = match names.as_slice() {
            [] => ToolChoice::None,
            [one] => ToolChoice::Function(one.clone()),
            _ => ToolChoice::Required,
        };
        if !names.is_empty() {
            let defs: Vec<serde_json::Value> = all
                .definitions()
                .iter()
                .filter(|d| {
                    d["function"]["name"]
                        .as_str()
                        .is_some_and(|n| names.iter().any(|x| x == n))
                })
                .cloned()
                .collect();
            let mut shown = ToolSet::new(&defs)?.with_format(all.format())?;
            // Values the request spells out are decoded as its own words.
            let spans = thorn_tools::request_spans(&user.content);
            for name in names.iter().filter(|_| !spans.is_empty()) {
                let from_request = match function_def(plugins, name).0 {
                    Some(def) if !def.from_request.is_empty() => &def.from_request,
                    _ => continue,
                };
                let Some(tool) = shown.get(name) else {
                    continue;
                };
                let narrowed =
                    thorn_tools::quote_from_request(&tool.parameters, from_request, &spans);
                // The spans are bounded, so this is not expected; the call is then decoded freely.
                if let Err(e) = shown.narrow(name, narrowed) {
                    tracing::warn!(function = %name, error = %e, "request spans not applied");
                }
            }
            plan.shown = Arc::new(shown);
        }
        plan.routed = Some(names);
    }
    let shown_host: Vec<&str> = plan
        .shown
        .tools()
        .iter()
        .map(|t| t.name.as_str())
        .filter(|n| turn.host_tools.iter().any(|h| h == n))
        .collect();
    if policy.examples
        && plan.choice != ToolChoice::None
        && !shown_host.is_empty()
        && shown_host.len() <= MAX_EXAMPLE_FUNCTIONS
    {
        plan.examples = example_turns(plugins, &shown_host);
    }
    Ok(plan)
}

/// The tool router over `tools` (in their order), reading each host function's examples and its
/// plugin's description from `plugins`.
pub fn router_for(plugins: &PluginSet, tools: &ToolSet) -> Router {
    Router::new(tools.tools().iter().map(|t| {
        let (def, context) = function_def(plugins, &t.name);
        RouteDoc {
            name: &t.name,
            description: &t.description,
            parameters: &t.parameters,
            examples: def.map_or(&[], |d| d.examples.as_slice()),
            context,
        }
    }))
}

/// The manifest entry of host function `name`, and its plugin's (or MCP server's) description.
fn function_def<'a>(
    plugins: &'a PluginSet,
    name: &str,
) -> (Option<&'a thorn_plugin::FunctionDef>, &'a str) {
    match plugins.provider_for(name) {
        Some(p) => (
            p.manifest().functions.iter().find(|f| f.name == name),
            p.manifest().description.as_str(),
        ),
        None => (None, ""),
    }
}

/// Example turns for `functions`: a user's request and the assistant's call, taken in turn from each
/// function so that every one is shown before any is shown twice.
fn example_turns(plugins: &PluginSet, functions: &[&str]) -> Vec<Message> {
    let lists: Vec<(&str, &[thorn_tools::Example])> = functions
        .iter()
        .map(|f| {
            (
                *f,
                function_def(plugins, f).0.map_or(&[][..], |d| &d.examples),
            )
        })
        .collect();
    let mut out = Vec::new();
    let mut n = 0;
    for i in 0.. {
        let mut any = false;
        for (name, examples) in &lists {
            let Some(e) = examples.get(i) else { continue };
            any = true;
            if n == MAX_EXAMPLE_TURNS {
                return out;
            }
            n += 1;
            out.push(Message::user(e.request.as_str()));
            let mut call = Message::assistant("");
            call.tool_calls.push(ToolCall {
                id: format!("example-{n}"),
                kind: "function",
                function: FunctionCall {
                    name: (*name).to_owned(),
                    arguments: e.arguments.clone(),
                },
            });
            out.push(call);
        }
        if !any {
            break;
        }
    }
    out
}

/// Puts `examples` into `messages` after the leading system messages.
pub(super) fn insert_examples(messages: &mut Vec<Message>, examples: Vec<Message>) {
    let at = messages
        .iter()
        .position(|m| m.role != Role::System)
        .unwrap_or(messages.len());
    messages.splice(at..at, examples);
}

/// The answer the templates give for a routed round's `calls`: `Some` only when every call succeeded and
/// its function has a template that renders.
pub(super) fn template_answer(plugins: &PluginSet, calls: &[HostCall]) -> Option<String> {
    let mut parts = Vec::with_capacity(calls.len());
    for c in calls {
        let result = c.result.as_ref().ok()?;
        let template = function_def(plugins, &c.call.function.name)
            .0?
            .answer
            .as_ref()?;
        match template.render(&c.call.function.arguments, result) {
            Ok(text) => parts.push(text),
            Err(e) => {
                tracing::warn!(function = %c.call.function.name, error = %e, "an answer template failed; the model answers");
                return None;
            }
        }
    }
    (!parts.is_empty()).then(|| parts.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn examples_go_after_the_system_messages() {
        let mut m = vec![Message::system("s"), Message::user("u")];
        insert_examples(&mut m, vec![Message::user("e"), Message::assistant("c")]);
        let roles: Vec<&str> = m.iter().map(|m| m.content.as_str()).collect();
        assert_eq!(roles, ["s", "e", "c", "u"]);
        let mut m = vec![Message::user("u")];
        insert_examples(&mut m, vec![Message::user("e")]);
        assert_eq!(m[0].content, "e");
    }
}
