//! Jinja chat templates rendered with minijinja, with the globals Hugging Face templates expect.
//!
//! HF compatibility: `messages`, `tools`, `add_generation_prompt`, `bos_token`, `eos_token`,
//! `raise_exception(msg)`, `strftime_now(fmt)`, Python string/dict methods (`.strip()`, `.items()`, via
//! minijinja-contrib's pycompat) and a `tojson` that formats like Python's `json.dumps` (`", "` and `": "`
//! separators, no HTML escaping, keys in insertion order), which is what the models saw in training.

use super::Message;
use minijinja::value::Kwargs;
use minijinja::{Environment, Error as JinjaError, ErrorKind, Value};
use serde::Serialize;
use thiserror::Error;

/// A template that failed to compile or render.
#[derive(Debug, Error)]
pub enum TemplateError {
    /// The template source does not parse.
    #[error("chat template does not compile: {0:#}")]
    Compile(JinjaError),
    /// Rendering failed (including `raise_exception` from the template itself).
    #[error("chat template failed to render: {0:#}")]
    Render(JinjaError),
}

/// Marks data text so that it cannot become control tokens (`Tokenizer::quote`); `None` when unchanged.
pub type Quote<'a> = &'a (dyn Fn(&str) -> Option<String> + Sync);

/// Inputs besides the messages.
#[derive(Clone, Default)]
pub struct RenderOptions<'a> {
    /// Append the assistant turn header so the model starts answering.
    pub add_generation_prompt: bool,
    /// Tool definitions (OpenAI `tools` entries) for templates that render them.
    pub tools: Option<&'a [serde_json::Value]>,
    /// `bos_token` as text.
    pub bos_token: &'a str,
    /// `eos_token` as text.
    pub eos_token: &'a str,
    /// Applied to every string of the messages and tools (data) before the template sees them, never to
    /// the template's own text or `bos_token`/`eos_token`. Prompts for a model must pass the tokenizer's
    /// quoting and be tokenized with `Tokenizer::encode_rendered`.
    pub quote: Option<Quote<'a>>,
    /// More template variables (a request's `chat_template_kwargs`: `enable_thinking`,
    /// `reasoning_effort`, ...), checked by [`check_kwargs`]; their strings are data too.
    pub kwargs: Option<&'a serde_json::Map<String, serde_json::Value>>,
}

/// The variables and functions a template's own context holds, which `kwargs` may not replace.
pub const RESERVED: [&str; 7] = [
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    "raise_exception",
    "strftime_now",
];

/// The most template variables one request may set, and the most bytes of their JSON.
pub const KWARGS_MAX: (usize, usize) = (32, 8192);

/// Checks a request's template variables: identifiers, not [`RESERVED`], within [`KWARGS_MAX`].
pub fn check_kwargs(kwargs: &serde_json::Map<String, serde_json::Value>) -> Result<(), String> {
    let (n, bytes) = KWARGS_MAX;
    if kwargs.len() > n {
        return Err(format!("more than {n} template variables"));
    }
    if serde_json::Value::Object(kwargs.clone()).to_string().len() > bytes {
        return Err(format!("template variables of more than {bytes} bytes"));
    }
    for k in kwargs.keys() {
        let ident = k
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ident {
            return Err(format!("{k:?} is not a template variable name"));
        }
        if RESERVED.contains(&k.as_str()) {
            return Err(format!("{k:?} is set by the server, not by a request"));
        }
    }
    Ok(())
}

impl std::fmt::Debug for RenderOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RenderOptions")
            .field("add_generation_prompt", &self.add_generation_prompt)
            .field("tools", &self.tools.map(<[_]>::len))
            .field("quoted", &self.quote.is_some())
            .finish()
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    knows_tools: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source` (the text of `tokenizer.chat_template`).
    pub fn new(source: &str) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source.to_owned())
            .map_err(TemplateError::Compile)?;
        Ok(ChatTemplate {
            env,
            knows_tools: source.contains("tools"),
        })
    }

    /// Whether the template renders `tools` and tool calls itself (it mentions `tools`); if not, the tool
    /// protocol is written into the messages ([`crate::ToolSet::messages_for`]).
    pub fn knows_tools(&self) -> bool {
        self.knows_tools
    }

    /// Renders a conversation to prompt text.
    pub fn render(
        &self,
        messages: &[Message],
        opts: &RenderOptions<'_>,
    ) -> Result<String, TemplateError> {
        #[derive(Serialize)]
        struct Ctx<'a> {
            messages: Vec<serde_json::Value>,
            tools: Option<&'a [serde_json::Value]>,
            add_generation_prompt: bool,
            bos_token: &'a str,
            eos_token: &'a str,
        }
        let quoted = opts.quote.map(|q| {
            let messages: Vec<Message> = messages.iter().map(|m| m.quoted(q)).collect();
            let tools: Option<Vec<serde_json::Value>> = opts
                .tools
                .map(|t| t.iter().map(|v| super::quote_json(v, q)).collect());
            (messages, tools)
        });
        let (messages, tools) = match &quoted {
            Some((m, t)) => (m.as_slice(), t.as_deref()),
            None => (messages, opts.tools),
        };
        let ctx = Ctx {
            messages: messages.iter().map(template_message).collect(),
            tools,
            add_generation_prompt: opts.add_generation_prompt,
            bos_token: opts.bos_token,
            eos_token: opts.eos_token,
        };
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(TemplateError::Render)?;
        let Some(kwargs) = opts.kwargs.filter(|k| !k.is_empty()) else {
            return tmpl
                .render(Value::from_serialize(&ctx))
                .map_err(TemplateError::Render);
        };
        // The request's variables first, the template's own context over them (never replaced).
        let mut all: serde_json::Map<String, serde_json::Value> = kwargs
            .iter()
            .filter(|(k, _)| !RESERVED.contains(&k.as_str()))
            .map(|(k, v)| {
                let v = match opts.quote {
                    Some(q) => super::quote_json(v, q),
                    None => v.clone(),
                };
                (k.clone(), v)
            })
            .collect();
        if let Ok(serde_json::Value::Object(own)) = serde_json::to_value(&ctx) {
            all.extend(own);
        }
        tmpl.render(Value::from_serialize(&all))
            .map_err(TemplateError::Render)
    }
}

/// A message as templates read it: its fields, and its reasoning also as `thinking` (gpt-oss's template
/// reads that name, and refuses a message with tool calls that has both text and thinking, so such a
/// message keeps its text only).
fn template_message(m: &Message) -> serde_json::Value {
    let mut v = serde_json::to_value(m).unwrap_or_default();
    if let (Some(r), Some(o)) = (&m.reasoning_content, v.as_object_mut())
        && (m.tool_calls.is_empty() || m.content.is_empty())
    {
        o.insert("thinking".into(), serde_json::Value::from(r.as_str()));
    }
    v
}

fn raise_exception(msg: String) -> Result<Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
}

/// Python-style `json.dumps(value, ensure_ascii=False, indent=indent)`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = Vec::new();
    let result = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                serde_json::ser::PrettyFormatter::with_indent(&pad),
            );
            json.serialize(&mut ser)
        }
        None => json.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out,
            PythonFormatter,
        )),
    };
    result.map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    // serde_json writes UTF-8 only.
    Ok(Value::from_safe_string(
        String::from_utf8(out).unwrap_or_default(),
    ))
}

/// `json.dumps` default separators: `", "` between items and `": "` after keys.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// `strftime_now(fmt)` for the directives chat templates use: `%Y %m %d %H %M %S %b %B %%`.
fn strftime_now(fmt: String) -> Result<Value, JinjaError> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(Value::from(strftime(&fmt, secs)))
}

fn strftime(fmt: &str, unix: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = (unix / 86_400) as i64;
    let rem = unix % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('B') => out.push_str(MONTHS[(month - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::{FunctionCall, Role, ToolCall};

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn request_kwargs_reach_the_template_as_data_and_never_replace_its_context() {
        // Qwen3's switch: with enable_thinking false the generation prompt closes an empty think block.
        let t = ChatTemplate::new(
            "{{ messages[0].content }}|{{ add_generation_prompt }}|{% if enable_thinking is defined and \
             enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{{ reasoning_effort | default('') }}",
        )
        .unwrap();
        let quote = |s: &str| s.contains('<').then(|| s.replace('<', "<\u{FDD0}"));
        let render = |kw: serde_json::Value| {
            let kw = kw.as_object().cloned().unwrap();
            let opts = RenderOptions {
                add_generation_prompt: true,
                quote: Some(&quote),
                kwargs: Some(&kw),
                ..Default::default()
            };
            t.render(&[Message::user("hi")], &opts).unwrap()
        };
        assert_eq!(render(serde_json::json!({})), "hi|True|");
        assert_eq!(
            render(serde_json::json!({"enable_thinking": false})),
            "hi|True|<think>\n\n</think>\n\n"
        );
        assert_eq!(
            render(serde_json::json!({"enable_thinking": true})),
            "hi|True|"
        );
        // A string variable is data: quoted like the messages.
        assert_eq!(
            render(serde_json::json!({"reasoning_effort": "<|im_end|>"})),
            "hi|True|<\u{FDD0}|im_end|>"
        );
        // The template's own variables win over a request's (and check_kwargs refuses them first).
        assert_eq!(
            render(serde_json::json!({"messages": [], "add_generation_prompt": false})),
            "hi|True|"
        );
        for (bad, why) in [
            (serde_json::json!({"messages": []}), "set by the server"),
            (
                serde_json::json!({"raise_exception": 1}),
                "set by the server",
            ),
            (
                serde_json::json!({"a-b": 1}),
                "not a template variable name",
            ),
            (serde_json::json!({"": 1}), "not a template variable name"),
            (serde_json::json!({"x": "y".repeat(9000)}), "bytes"),
        ] {
            let e = check_kwargs(bad.as_object().unwrap()).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
        let many: serde_json::Map<String, serde_json::Value> = (0..33)
            .map(|i| (format!("k{i}"), serde_json::json!(i)))
            .collect();
        assert!(check_kwargs(&many).is_err());
        assert!(
            check_kwargs(
                serde_json::json!({"enable_thinking": false})
                    .as_object()
                    .unwrap()
            )
            .is_ok()
        );
    }

    #[test]
    fn renders_chatml_with_default_system_prompt() {
        let t = ChatTemplate::new(CHATML).unwrap();
        let opts = RenderOptions {
            add_generation_prompt: true,
            ..Default::default()
        };
        let s = t.render(&[Message::user("Hi")], &opts).unwrap();
        assert_eq!(
            s,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn tools_tojson_and_python_methods() {
        let src = "{% for t in tools %}{{ t | tojson }}\n{% endfor %}{{ messages[0].content.strip().upper() }}|{% for m in messages %}{% for c in m.tool_calls %}{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}";
        let t = ChatTemplate::new(src).unwrap();
        let tools = vec![
            serde_json::json!({"type": "function", "function": {"name": "w", "parameters": {"z": 1, "a": ["<b>", "é"]}}}),
        ];
        let mut call = Message::new(Role::Assistant, "");
        call.tool_calls.push(ToolCall {
            id: "c1".into(),
            kind: "function",
            function: FunctionCall {
                name: "w".into(),
                arguments: serde_json::json!({"city": "Paris", "n": 2}),
            },
        });
        let opts = RenderOptions {
            tools: Some(&tools),
            ..Default::default()
        };
        let s = t.render(&[Message::user("  hi  "), call], &opts).unwrap();
        assert_eq!(
            s,
            "{\"type\": \"function\", \"function\": {\"name\": \"w\", \"parameters\": {\"z\": 1, \"a\": [\"<b>\", \"é\"]}}}\nHI|{\"city\": \"Paris\", \"n\": 2}"
        );
    }

    #[test]
    fn reasoning_content_renders_where_the_template_reads_it_and_is_quoted() {
        // The shape of a thinking model's template (Qwen3's keeps earlier reasoning in <think> blocks).
        let src = "{% for m in messages %}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}|{% endfor %}";
        let t = ChatTemplate::new(src).unwrap();
        let mut a = Message::assistant("42");
        a.reasoning_content = Some("six times <|im_end|> seven".into());
        let quote = |s: &str| Some(s.replace("<|", "<\u{FDD0}|"));
        let opts = RenderOptions {
            quote: Some(&quote),
            ..Default::default()
        };
        let s = t.render(&[Message::user("6*7?"), a], &opts).unwrap();
        assert_eq!(
            s,
            "6*7?|<think>six times <\u{FDD0}|im_end|> seven</think>42|"
        );
    }

    #[test]
    fn raise_exception_and_syntax_errors_are_typed() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}").unwrap();
        let e = t.render(&[], &RenderOptions::default()).unwrap_err();
        assert!(
            matches!(e, TemplateError::Render(_)) && e.to_string().contains("roles must alternate"),
            "{e}"
        );
        assert!(matches!(
            ChatTemplate::new("{% for %}"),
            Err(TemplateError::Compile(_))
        ));
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2026-11-30T12:34:56Z
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %B %%", 1_796_042_096),
            "30 Nov 2026 12:34:56 November %"
        );
        assert_eq!(strftime("%Y-%m-%d", 951_782_400), "2000-02-29");
    }
}
