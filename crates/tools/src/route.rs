//! Tool routing: which of a request's tools the model should see for the user's message, if any.
//!
//! A 135M-parameter model offered twelve tools with `tool_choice: auto` calls none of them (0 of 40 tool
//! tasks); forced to call, it calls one for every message, greetings included, and picks the wrong function
//! a quarter of the time. Deciding *whether* to call and *which* function is a retrieval problem, and a
//! small one: a few dozen short documents. So the router scores each function against the message and the
//! agent shows the model only what passed (forcing the call), or no tools at all.
//!
//! Scoring is lexical, over the words a tool's author wrote: the function's name (weight 3), its
//! description (2), its examples' requests (2), its parameters' names, descriptions and enum values (1)
//! and its plugin's description (1); a word in several of these adds their weights, up to 5. Words are lower-cased, stop words dropped and the rest stemmed
//! (Snowball English), and an arithmetic operator between numbers (`17 * 3`) counts as the word
//! [`ARITHMETIC`] (weight 3 wherever it appears). A function's score is the sum over the message's
//! distinct words of the word's weight in the function times its rarity across the N functions
//! (`ln(1 + N/df) / ln(1 + N)`: 1 for a word only one function mentions), so a word unique to one
//! function's description scores 2; its *coverage* is the share of the message's word rarity it matched,
//! where a word no tool mentions counts as rare as a word one tool mentions. A function is routed when its score and coverage both pass the thresholds ([`RouteConfig`]):
//! "What is the capital of France?" shares no word with any tool, "Give me one tip for sleeping better"
//! matches the arm's "tool tip" with a third of its words, and neither gets a tool.
//!
//! Building a router costs microseconds for a plugin set (a map per function); it holds no model and no
//! state between requests.

use crate::usage::Example;
use rust_stemmers::{Algorithm, Stemmer};
use serde_json::Value;
use std::collections::HashMap;

/// The word an arithmetic operator between numbers stands for.
pub const ARITHMETIC: &str = "\u{2218}arithmetic";

/// Most weight one word has in one function.
const MAX_WEIGHT: f32 = 5.0;

/// What the router reads about one function.
#[derive(Debug, Clone, Copy)]
pub struct RouteDoc<'a> {
    /// The function's name.
    pub name: &'a str,
    /// Its description.
    pub description: &'a str,
    /// Its parameters schema.
    pub parameters: &'a Value,
    /// Its examples.
    pub examples: &'a [Example],
    /// What its plugin is (the plugin's description), or "".
    pub context: &'a str,
}

/// Thresholds of a route.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouteConfig {
    /// Least score of a routed function.
    pub min_score: f32,
    /// Least coverage of a routed function.
    pub min_coverage: f32,
    /// Functions within this fraction of the best score are routed with it (1.0: only the best).
    pub keep: f32,
    /// Most functions routed.
    pub max_tools: usize,
}

impl Default for RouteConfig {
    fn default() -> Self {
        RouteConfig {
            min_score: 2.0,
            min_coverage: 0.4,
            keep: 0.9,
            max_tools: 3,
        }
    }
}

/// One function's standing for a message.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ranked {
    /// Its index among the documents the router was built from.
    pub index: usize,
    /// Its score.
    pub score: f32,
    /// Its coverage of the message, 0 to 1.
    pub coverage: f32,
}

/// Scores functions against messages.
pub struct Router {
    stemmer: Stemmer,
    /// Per function: word -> its weight there (the best field it appears in).
    docs: Vec<HashMap<String, f32>>,
    /// Word -> how many functions mention it.
    df: HashMap<String, usize>,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("functions", &self.docs.len())
            .field("words", &self.df.len())
            .finish()
    }
}

/// Words that say nothing about which tool is meant.
const STOP: &[&str] = &[
    "a", "about", "after", "again", "all", "am", "an", "and", "any", "are", "as", "at", "be",
    "been", "but", "by", "can", "could", "did", "do", "does", "doing", "for", "from", "get",
    "give", "had", "has", "have", "he", "her", "here", "him", "his", "how", "i", "if", "in",
    "into", "is", "it", "its", "just", "let", "me", "my", "no", "not", "now", "of", "on", "or",
    "our", "out", "please", "she", "should", "so", "some", "tell", "than", "that", "the", "their",
    "them", "then", "there", "these", "they", "this", "those", "to", "up", "us", "was", "we",
    "were", "what", "when", "where", "which", "who", "why", "will", "with", "would", "you", "your",
];

impl Router {
    /// A router over `docs` (their order is the order of [`Ranked::index`]).
    pub fn new<'a>(docs: impl IntoIterator<Item = RouteDoc<'a>>) -> Self {
        let stemmer = Stemmer::create(Algorithm::English);
        let mut r = Router {
            stemmer,
            docs: Vec::new(),
            df: HashMap::new(),
        };
        let mut words = Vec::new();
        for d in docs {
            let mut w: HashMap<String, f32> = HashMap::new();
            // Each field a word appears in adds its weight once (the examples count as one field).
            let mut add = |text: &str, weight: f32, words: &mut Vec<String>| {
                words.clear();
                r.words(text, words);
                words.sort_unstable();
                words.dedup();
                for t in words.drain(..) {
                    // An expression anywhere in a function's text says it computes.
                    let weight = if t == ARITHMETIC { MAX_WEIGHT } else { weight };
                    let e = w.entry(t).or_insert(0.0);
                    *e = (*e + weight).min(MAX_WEIGHT);
                }
            };
            add(d.name, 3.0, &mut words);
            add(d.description, 2.0, &mut words);
            let requests: Vec<&str> = d.examples.iter().map(|e| e.request.as_str()).collect();
            add(&requests.join("\n"), 2.0, &mut words);
            let mut schema_text = String::new();
            schema_words(d.parameters, &mut schema_text, 0);
            add(&schema_text, 1.0, &mut words);
            add(d.context, 1.0, &mut words);
            for t in w.keys() {
                *r.df.entry(t.clone()).or_insert(0) += 1;
            }
            r.docs.push(w);
        }
        r
    }

    /// How many functions it routes among.
    pub fn len(&self) -> usize {
        self.docs.len()
    }

    /// Whether it has none.
    pub fn is_empty(&self) -> bool {
        self.docs.is_empty()
    }

    /// The words of `text` as the router compares them: lower-cased, stop words out, stemmed, and
    /// [`ARITHMETIC`] for each operator between numbers.
    pub fn words(&self, text: &str, out: &mut Vec<String>) {
        let lower = text.to_lowercase();
        let chars: Vec<char> = lower.chars().collect();
        let mut word = String::new();
        let flush = |word: &mut String, out: &mut Vec<String>| {
            if !word.is_empty()
                && !word.chars().all(|c| c.is_ascii_digit())
                && !STOP.contains(&word.as_str())
            {
                out.push(self.stemmer.stem(word).into_owned());
            }
            word.clear();
        };
        for (i, &c) in chars.iter().enumerate() {
            if c.is_alphanumeric() {
                word.push(c);
                continue;
            }
            flush(&mut word, out);
            if "+-*/^%×÷".contains(c) && arithmetic_at(&chars, i) {
                out.push(ARITHMETIC.to_owned());
            }
        }
        flush(&mut word, out);
    }

    /// Every function's standing for `message`, best first (ties by index).
    pub fn rank(&self, message: &str) -> Vec<Ranked> {
        self.rank_among(message, |_| true)
    }

    /// The standing of the functions `among` admits (by index), best first. A word's rarity is still
    /// counted over every function the router was built from, so a function scores the same whatever
    /// else a request offers: build the router over every installed function, and rank a request's own
    /// among them.
    pub fn rank_among(&self, message: &str, among: impl Fn(usize) -> bool) -> Vec<Ranked> {
        let mut words = Vec::new();
        self.words(message, &mut words);
        words.sort_unstable();
        words.dedup();
        let n = self.docs.len() as f32;
        // 1 for a word one function mentions (or none does), less the more functions mention it.
        let rarity = |t: &str| match self.df.get(t).copied().unwrap_or(1) {
            0 | 1 => 1.0,
            df => (1.0 + n / df as f32).ln() / (1.0 + n).ln(),
        };
        let total: f32 = words.iter().map(|t| rarity(t)).sum();
        let mut out: Vec<Ranked> = self
            .docs
            .iter()
            .enumerate()
            .filter(|(index, _)| among(*index))
            .map(|(index, d)| {
                let (mut score, mut matched) = (0.0f32, 0.0f32);
                for t in &words {
                    if let Some(w) = d.get(t) {
                        let r = rarity(t);
                        score += w * r;
                        matched += r;
                    }
                }
                Ranked {
                    index,
                    score,
                    coverage: if total > 0.0 { matched / total } else { 0.0 },
                }
            })
            .collect();
        out.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.index.cmp(&b.index)));
        out
    }

    /// The functions to offer for `message` under `cfg` (best first), or none: the message needs no tool.
    pub fn route(&self, message: &str, cfg: &RouteConfig) -> Vec<Ranked> {
        self.route_among(message, cfg, |_| true)
    }

    /// [`Router::route`] among the functions `among` admits (see [`Router::rank_among`]).
    pub fn route_among(
        &self,
        message: &str,
        cfg: &RouteConfig,
        among: impl Fn(usize) -> bool,
    ) -> Vec<Ranked> {
        let ranked = self.rank_among(message, among);
        let Some(best) = ranked.first().copied() else {
            return Vec::new();
        };
        if best.score < cfg.min_score || best.coverage < cfg.min_coverage {
            return Vec::new();
        }
        ranked
            .into_iter()
            .take_while(|r| r.score >= best.score * cfg.keep && r.score >= cfg.min_score)
            .take(cfg.max_tools.max(1))
            .collect()
    }
}

/// Whether the operator at `i` stands between numbers (or parentheses): `17 * 3`, `(1+2)/3`, not `km/h`.
fn arithmetic_at(chars: &[char], i: usize) -> bool {
    let operand = |c: char, open: char| c.is_ascii_digit() || c == '.' || c == open;
    let before = chars[..i].iter().rev().find(|c| !c.is_whitespace());
    let after = chars[i + 1..].iter().find(|c| !c.is_whitespace());
    matches!((before, after), (Some(&b), Some(&a)) if operand(b, ')') && operand(a, '('))
}

/// The words a schema offers: property names, descriptions, string enum values (bounded depth).
fn schema_words(v: &Value, out: &mut String, depth: usize) {
    if depth > 8 {
        return;
    }
    match v {
        Value::Object(o) => {
            if let Some(Value::String(d)) = o.get("description") {
                out.push_str(d);
                out.push(' ');
            }
            if let Some(Value::Array(e)) = o.get("enum") {
                for s in e.iter().filter_map(Value::as_str) {
                    out.push_str(s);
                    out.push(' ');
                }
            }
            if let Some(Value::Object(props)) = o.get("properties") {
                for (k, p) in props {
                    out.push_str(k);
                    out.push(' ');
                    schema_words(p, out, depth + 1);
                }
            }
            for k in ["items", "anyOf", "oneOf", "allOf"] {
                match o.get(k) {
                    Some(Value::Array(a)) => a.iter().for_each(|x| schema_words(x, out, depth + 1)),
                    Some(x @ Value::Object(_)) => schema_words(x, out, depth + 1),
                    _ => {}
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|x| schema_words(x, out, depth + 1)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn router() -> (Router, Vec<&'static str>) {
        let calc = json!({"type": "object", "properties": {"expression": {"type": "string",
            "description": "An arithmetic expression, e.g. 2 * (3 + 4)"}}});
        let units = json!({"type": "object", "properties": {"value": {"type": "number"},
            "from": {"enum": ["km", "mi", "kg", "lb"]}, "to": {"enum": ["km", "mi", "kg", "lb"]}}});
        let files = json!({"type": "object", "properties": {"path": {"type": "string",
            "description": "A directory"}}});
        let ex = [Example {
            request: "How many pounds is 3 kilograms?".into(),
            arguments: json!({"value": 3, "from": "kg", "to": "lb"}),
        }];
        let docs = vec![
            RouteDoc {
                name: "evaluate",
                description: "Evaluates arithmetic: add, subtract, multiply, divide.",
                parameters: &calc,
                examples: &[],
                context: "A calculator.",
            },
            RouteDoc {
                name: "convert",
                description: "Converts an amount between units of length and mass.",
                parameters: &units,
                examples: &ex,
                context: "Unit conversion.",
            },
            RouteDoc {
                name: "list_files",
                description: "Lists the files of a directory.",
                parameters: &files,
                examples: &[],
                context: "Reads a workspace.",
            },
        ];
        (Router::new(docs), vec!["evaluate", "convert", "list_files"])
    }

    fn routed(r: &Router, names: &[&str], msg: &str) -> Vec<String> {
        r.route(msg, &RouteConfig::default())
            .iter()
            .map(|x| names[x.index].to_owned())
            .collect()
    }

    #[test]
    fn words_are_stemmed_without_stop_words_and_operators_count_between_numbers() {
        let (r, _) = router();
        let mut w = Vec::new();
        r.words("What is 17 * 3? Listing the files, in km/h!", &mut w);
        assert_eq!(w, vec![ARITHMETIC, "list", "file", "km", "h"]);
        w.clear();
        r.words("(1+2)/ 3 and -4", &mut w);
        assert_eq!(w, vec![ARITHMETIC, ARITHMETIC], "a leading minus is a sign");
    }

    #[test]
    fn messages_go_to_the_function_they_are_about() {
        let (r, n) = router();
        assert_eq!(routed(&r, &n, "What is 17 * 3?"), ["evaluate"]);
        assert_eq!(routed(&r, &n, "Please multiply 12 by 4"), ["evaluate"]);
        assert_eq!(routed(&r, &n, "Convert 10 km to mi"), ["convert"]);
        assert_eq!(
            routed(&r, &n, "How many kilograms is 150 pounds?"),
            ["convert"]
        );
        assert_eq!(
            routed(&r, &n, "List the files in the directory"),
            ["list_files"]
        );
    }

    #[test]
    fn messages_no_tool_is_about_get_none() {
        let (r, n) = router();
        for m in [
            "What is the capital of France?",
            "Hello! How are you?",
            "Write a haiku about rain.",
            "",
            "?!",
            "List three red fruits and their colours, briefly",
        ] {
            assert!(
                routed(&r, &n, m).is_empty(),
                "{m:?} -> {:?}",
                routed(&r, &n, m)
            );
        }
    }

    #[test]
    fn a_function_scores_the_same_among_any_subset_of_the_installed_ones() {
        let (r, n) = router();
        for m in [
            "What is 17 * 3?",
            "Convert 10 km to mi",
            "List the files in the directory",
            "Hello! How are you?",
        ] {
            let full = r.rank(m);
            for keep in 0..n.len() {
                let alone = r.rank_among(m, |i| i == keep);
                assert_eq!(alone.len(), 1);
                let same = full.iter().find(|x| x.index == keep).unwrap();
                assert_eq!(alone[0], *same, "{m:?} {}", n[keep]);
                let routed_full = routed(&r, &n, m).contains(&n[keep].to_owned());
                let routed_alone = !r
                    .route_among(m, &RouteConfig::default(), |i| i == keep)
                    .is_empty();
                assert_eq!(routed_full, routed_alone, "{m:?} {}", n[keep]);
            }
        }
    }

    #[test]
    fn ranking_is_deterministic_and_keep_widens_the_route() {
        let (r, n) = router();
        assert_eq!(r.rank("files"), r.rank("files"));
        let wide = RouteConfig {
            keep: 0.0,
            min_score: 0.0,
            min_coverage: 0.0,
            max_tools: 2,
        };
        assert_eq!(r.route("divide the files", &wide).len(), 2);
        assert!(Router::new([]).route("anything", &wide).is_empty());
        assert_eq!(n.len(), r.len());
    }
}
