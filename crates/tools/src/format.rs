//! Tool-call formats: how a model family writes a call, as data the rest of the tool layer asks for (the
//! grammar that constrains a call, its parser, its streaming lexer, how a past call is written back into a
//! prompt). A [`ToolSet`] carries the format its model writes ([`ToolSet::with_format`]); detected from
//! the chat template ([`ToolFormat::detect`]) unless the operator names one (`--tool-format`).

pub mod gemma;
pub mod harmony;
pub mod llama_json;
pub mod mistral;
pub mod qwen_xml;
mod xml_stream;

pub use xml_stream::XmlStreamer;

use crate::{CallDelta, CallStreamer, ParsedCall, ToolError, ToolSet};
use serde_json::Value;

/// A family's tool-call format; each variant's doc shows the text its models write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ToolFormat {
    /// Hermes JSON (SmolLM2, Qwen2.5, Qwen3, Hermes, and thorn's own prompt for templates without tools):
    /// `<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>`.
    #[default]
    Hermes,
    /// Qwen3's XML parameters (Qwen3-Coder, Qwen3.5/3.6):
    /// `<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>`.
    QwenXml,
    /// Llama 3.x's bare JSON objects, several separated by `; `:
    /// `{"name": "get_weather", "parameters": {"city": "Paris"}}`.
    Llama3Json,
    /// Mistral's control token and a JSON array of calls (Mistral 7B v0.3, Nemo, Small 3.x, Devstral):
    /// `[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]`.
    Mistral,
    /// Mistral's newer form (Small 3.2, Devstral, Magistral), a control token between name and arguments:
    /// `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`.
    MistralArgs,
    /// Gemma 4's calls, keys bare and strings quoted by a control token:
    /// `<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>`.
    Gemma,
    /// FunctionGemma's, the same with other delimiters:
    /// `<start_function_call>call:get_weather{city:<escape>Paris<escape>}<end_function_call>`.
    FunctionGemma,
    /// OpenAI's harmony messages (gpt-oss): a call is a message to its recipient on the commentary
    /// channel, `<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":
    /// "Paris"}<|call|>`; reasoning is the analysis channel, the answer the final one.
    Harmony,
}

impl ToolFormat {
    /// Every format, in the order [`ToolFormat::detect`] tries them.
    pub const ALL: [ToolFormat; 8] = [
        ToolFormat::Harmony,
        ToolFormat::Gemma,
        ToolFormat::FunctionGemma,
        ToolFormat::QwenXml,
        ToolFormat::MistralArgs,
        ToolFormat::Mistral,
        ToolFormat::Llama3Json,
        ToolFormat::Hermes,
    ];

    /// Its name (`--tool-format NAME`).
    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::QwenXml => "qwen3_xml",
            ToolFormat::Llama3Json => "llama3_json",
            ToolFormat::Mistral => "mistral",
            ToolFormat::MistralArgs => "mistral_args",
            ToolFormat::Harmony => "harmony",
            ToolFormat::Gemma => "gemma",
            ToolFormat::FunctionGemma => "functiongemma",
        }
    }

    /// The format named `name`.
    pub fn from_name(name: &str) -> Result<ToolFormat, ToolError> {
        Self::ALL
            .into_iter()
            .find(|f| f.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|f| f.name()).collect();
                ToolError::Request(format!(
                    "unknown tool-call format {name:?} (known: {})",
                    names.join(", ")
                ))
            })
    }

    /// The format a chat template's own tool calls are written in (as llama.cpp tells them apart: by what
    /// the template writes for an assistant's calls), Hermes when it shows none.
    pub fn detect(template_source: &str) -> ToolFormat {
        if template_source.contains(harmony::CHANNEL) && template_source.contains(harmony::CALL) {
            ToolFormat::Harmony
        } else if template_source.contains(gemma::GEMMA4.open) {
            ToolFormat::Gemma
        } else if template_source.contains(gemma::FUNCTION_GEMMA.open) {
            ToolFormat::FunctionGemma
        } else if template_source.contains("<function=") && template_source.contains("<parameter=")
        {
            ToolFormat::QwenXml
        } else if template_source.contains(mistral::OPEN) && template_source.contains(mistral::ARGS)
        {
            ToolFormat::MistralArgs
        } else if template_source.contains(mistral::OPEN) {
            ToolFormat::Mistral
        } else if template_source.contains(llama_json::PYTHON_TAG) {
            ToolFormat::Llama3Json
        } else {
            ToolFormat::Hermes
        }
    }

    /// The text that starts a call (a tool-choice `auto` grammar switches on there).
    pub fn trigger(self) -> &'static str {
        match self {
            ToolFormat::Hermes => crate::OPEN,
            ToolFormat::QwenXml => qwen_xml::OPEN,
            ToolFormat::Llama3Json => llama_json::TRIGGER,
            ToolFormat::Mistral | ToolFormat::MistralArgs => mistral::OPEN,
            ToolFormat::Harmony => harmony::TRIGGER,
            ToolFormat::Gemma => gemma::GEMMA4.open,
            ToolFormat::FunctionGemma => gemma::FUNCTION_GEMMA.open,
        }
    }

    /// The Gemma dialect of this format, if it is one.
    fn gemma(self) -> Option<gemma::Dialect> {
        match self {
            ToolFormat::Gemma => Some(gemma::GEMMA4),
            ToolFormat::FunctionGemma => Some(gemma::FUNCTION_GEMMA),
            _ => None,
        }
    }

    /// The control tokens this format writes as part of its syntax: the output shows them as text (a
    /// model without them writes the same text in ordinary tokens).
    pub fn controls(self) -> &'static [&'static str] {
        match self {
            ToolFormat::Hermes | ToolFormat::QwenXml | ToolFormat::Llama3Json => &[],
            ToolFormat::Mistral => &[mistral::OPEN],
            ToolFormat::MistralArgs => &[mistral::OPEN, mistral::ARGS, mistral::CALL_ID],
            ToolFormat::Harmony => &harmony::CONTROLS,
            ToolFormat::Gemma => &[
                gemma::GEMMA4.open,
                gemma::GEMMA4.close,
                gemma::GEMMA4.quote,
                "<|channel>",
                gemma::THINK_CLOSE,
            ],
            ToolFormat::FunctionGemma => &[
                gemma::FUNCTION_GEMMA.open,
                gemma::FUNCTION_GEMMA.close,
                gemma::FUNCTION_GEMMA.quote,
            ],
        }
    }

    /// How the model's reasoning is marked in its output: harmony's analysis channel, `<think>` for the
    /// rest.
    pub const fn reasoning(self) -> ReasoningTags {
        match self {
            ToolFormat::Harmony => ReasoningTags {
                open: harmony::THINK_OPEN,
                close: harmony::END,
                closing: harmony::CLOSE_ANALYSIS,
            },
            ToolFormat::Gemma => ReasoningTags {
                open: gemma::THINK_OPEN,
                close: gemma::THINK_CLOSE,
                closing: gemma::THINK_CLOSE,
            },
            _ => ReasoningTags {
                open: "<think>",
                close: "</think>",
                closing: "\n</think>\n\n",
            },
        }
    }

    /// Whether the output is messages on channels (harmony), which [`harmony::HarmonyStreamer`] splits
    /// into reasoning, answer text and calls.
    pub fn has_channels(self) -> bool {
        self == ToolFormat::Harmony
    }

    /// A call id as this format's templates need it (Mistral's take nine letters and digits).
    pub fn template_id(self, id: &str) -> String {
        match self {
            ToolFormat::Mistral | ToolFormat::MistralArgs => mistral::template_id(id),
            _ => id.to_owned(),
        }
    }

    /// Checks that `tools` can be called in this format.
    pub fn check(self, tools: &ToolSet) -> Result<(), ToolError> {
        match self {
            ToolFormat::Hermes
            | ToolFormat::Llama3Json
            | ToolFormat::Mistral
            | ToolFormat::MistralArgs
            | ToolFormat::Harmony
            | ToolFormat::Gemma
            | ToolFormat::FunctionGemma => Ok(()),
            ToolFormat::QwenXml => qwen_xml::check_names(tools),
        }
    }

    /// The Lark grammar of calls to `tools` (or just `only`; several with `parallel`; with `answer` a JSON
    /// answer as the alternative).
    pub fn calls_grammar(
        self,
        tools: &ToolSet,
        only: Option<&str>,
        parallel: bool,
        answer: Option<&Value>,
    ) -> String {
        match self {
            ToolFormat::Hermes => {
                crate::grammar::hermes_calls_grammar(tools, only, parallel, answer)
            }
            ToolFormat::QwenXml => qwen_xml::calls_grammar(tools, only, parallel, answer),
            ToolFormat::Llama3Json => llama_json::calls_grammar(tools, only, parallel, answer),
            ToolFormat::Mistral => mistral::calls_grammar(tools, only, parallel, answer),
            ToolFormat::MistralArgs => mistral::args_calls_grammar(tools, only, parallel, answer),
            ToolFormat::Harmony => harmony::calls_grammar(tools, only, parallel, answer),
            ToolFormat::Gemma => gemma::GEMMA4.calls_grammar(tools, only, parallel, answer),
            ToolFormat::FunctionGemma => {
                gemma::FUNCTION_GEMMA.calls_grammar(tools, only, parallel, answer)
            }
        }
    }

    /// Splits generated text into prose and calls.
    pub fn parse(
        self,
        tools: &ToolSet,
        text: &str,
    ) -> Result<(String, Vec<ParsedCall>), ToolError> {
        match self {
            ToolFormat::Hermes => crate::parse_tool_calls(text),
            ToolFormat::QwenXml => qwen_xml::parse(tools, text),
            ToolFormat::Llama3Json => llama_json::parse(text),
            ToolFormat::Mistral => mistral::parse(text),
            ToolFormat::MistralArgs => mistral::args_parse(text),
            ToolFormat::Harmony => harmony::parse(text),
            ToolFormat::Gemma => gemma::GEMMA4.parse(text),
            ToolFormat::FunctionGemma => gemma::FUNCTION_GEMMA.parse(text),
        }
    }

    /// The part of a cut-short generation that holds only complete calls.
    pub fn complete_prefix<'a>(self, tools: &ToolSet, text: &'a str) -> &'a str {
        match self {
            ToolFormat::Hermes => crate::complete_calls_prefix(text),
            ToolFormat::QwenXml => qwen_xml::complete_prefix(tools, text),
            ToolFormat::Llama3Json => llama_json::complete_prefix(text),
            ToolFormat::Mistral => mistral::complete_prefix(text),
            ToolFormat::MistralArgs => mistral::args_complete_prefix(text),
            ToolFormat::Harmony => harmony::complete_prefix(text),
            ToolFormat::Gemma => gemma::GEMMA4.complete_prefix(text),
            ToolFormat::FunctionGemma => gemma::FUNCTION_GEMMA.complete_prefix(text),
        }
    }

    /// A past call as this format writes it (for a template that does not render calls itself).
    pub fn write_call(self, tools: &ToolSet, name: &str, arguments: &Value) -> String {
        match self {
            ToolFormat::Hermes => {
                let call = serde_json::json!({"name": name, "arguments": arguments});
                format!("{}{call}{}", crate::OPEN, crate::CLOSE)
            }
            ToolFormat::QwenXml => qwen_xml::write_call(tools, name, arguments),
            ToolFormat::Llama3Json => llama_json::write_call(name, arguments),
            ToolFormat::Mistral => mistral::write_call(name, arguments),
            ToolFormat::MistralArgs => mistral::args_write_call(name, arguments),
            ToolFormat::Harmony => harmony::write_call(name, arguments),
            ToolFormat::Gemma => gemma::GEMMA4.write_call(name, arguments),
            ToolFormat::FunctionGemma => gemma::FUNCTION_GEMMA.write_call(name, arguments),
        }
    }

    /// The system-prompt block that teaches the format to a model whose template does not render tools.
    pub fn instructions(self, list: &str) -> String {
        match self {
            ToolFormat::Hermes => format!(
                "You are a function-calling assistant. You have access to the following tools:\n<tools>\n{list}\n</tools>\n\
                 When a tool is needed, reply only with a JSON object of the form {{\"name\": <function-name>, \"arguments\": <args-object>}} \
                 inside <tool_call></tool_call> tags."
            ),
            ToolFormat::QwenXml => format!(
                "# Tools\n\nYou have access to the following functions:\n\n<tools>\n{list}\n</tools>\n\n\
                 If you choose to call a function ONLY reply in the following format with NO suffix:\n\n\
                 <tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n\
                 </function>\n</tool_call>"
            ),
            ToolFormat::Llama3Json => llama_json::instructions(list),
            ToolFormat::Mistral => format!(
                "You have access to the following tools:\n{list}\n\nTo call tools, reply only with {} followed by a JSON \
                 array of calls: [{{\"name\": <function-name>, \"arguments\": <args-object>}}].",
                mistral::OPEN
            ),
            ToolFormat::MistralArgs => format!(
                "You have access to the following tools:\n{list}\n\nTo call a tool, reply only with {}, its name, {} \
                 and its arguments as a JSON object; repeat for more calls.",
                mistral::OPEN,
                mistral::ARGS
            ),
            ToolFormat::Harmony => harmony::instructions(list),
            ToolFormat::Gemma | ToolFormat::FunctionGemma => {
                let d = self.gemma().unwrap_or(gemma::GEMMA4);
                format!(
                    "You have access to the following functions:\n{list}\n\nTo call one, write {}call:NAME{{key:value,...}}{} \
                     with the arguments' keys bare and every string between {} marks.",
                    d.open, d.close, d.quote
                )
            }
        }
    }

    /// How many calls `text` begins (complete or not), as this format's streaming lexer reads it.
    pub fn calls_begun(self, tools: &ToolSet, text: &str) -> usize {
        if self.has_channels() {
            let mut s = harmony::HarmonyStreamer::new();
            s.push(text, &mut |_| {});
            return s.begun();
        }
        let Some(at) = text.find(self.trigger()) else {
            return 0;
        };
        let mut s = self.streamer(tools);
        s.push(&text[at..], &mut |_| {});
        s.begun()
    }

    /// A streaming lexer of calls to `tools` in this format.
    pub fn streamer(self, tools: &ToolSet) -> FormatStreamer {
        match self {
            ToolFormat::Hermes => FormatStreamer::Hermes(CallStreamer::default()),
            ToolFormat::QwenXml => FormatStreamer::QwenXml(XmlStreamer::new(tools)),
            // Every object written after the trigger is a call (the array's brackets and commas are not).
            ToolFormat::Llama3Json | ToolFormat::Mistral | ToolFormat::Harmony => {
                FormatStreamer::Hermes(CallStreamer::bare())
            }
            ToolFormat::MistralArgs => FormatStreamer::MistralArgs(mistral::ArgsStreamer::new()),
            ToolFormat::Gemma | ToolFormat::FunctionGemma => FormatStreamer::Gemma(
                gemma::GemmaStreamer::new(self.gemma().unwrap_or(gemma::GEMMA4)),
            ),
        }
    }
}

/// Where a model's reasoning starts and ends in its output (see [`ToolFormat::reasoning`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReasoningTags {
    /// What opens it.
    pub open: &'static str,
    /// What closes it.
    pub close: &'static str,
    /// The text the engine writes to close it when a reasoning budget is spent (control tokens as text).
    pub closing: &'static str,
}

impl std::fmt::Display for ToolFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ToolFormat {
    type Err = ToolError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ToolFormat::from_name(s)
    }
}

/// The streaming lexer of one format (see [`ToolFormat::streamer`]).
#[derive(Debug)]
pub enum FormatStreamer {
    /// JSON calls (Hermes' tagged objects, Llama 3's bare ones).
    Hermes(CallStreamer),
    /// Qwen3 XML.
    QwenXml(XmlStreamer),
    /// Mistral's `[TOOL_CALLS]NAME[ARGS]{...}`.
    MistralArgs(mistral::ArgsStreamer),
    /// Gemma's `call:NAME{...}`.
    Gemma(gemma::GemmaStreamer),
}

impl Default for FormatStreamer {
    fn default() -> Self {
        FormatStreamer::Hermes(CallStreamer::default())
    }
}

impl FormatStreamer {
    /// Feeds generated text (from the trigger on); `out` gets the deltas it completes.
    pub fn push(&mut self, text: &str, out: &mut dyn FnMut(CallDelta)) {
        match self {
            FormatStreamer::Hermes(s) => s.push(text, out),
            FormatStreamer::QwenXml(s) => s.push(text, out),
            FormatStreamer::MistralArgs(s) => s.push(text, out),
            FormatStreamer::Gemma(s) => s.push(text, out),
        }
    }

    /// Calls begun so far.
    pub fn begun(&self) -> usize {
        match self {
            FormatStreamer::Hermes(s) => s.begun(),
            FormatStreamer::QwenXml(s) => s.begun(),
            FormatStreamer::MistralArgs(s) => s.begun(),
            FormatStreamer::Gemma(s) => s.begun(),
        }
    }
}

#[cfg(test)]
mod tests;
