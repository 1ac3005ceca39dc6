//! The key-value memory tool: lets an agent remember short notes across calls and conversations. Every call
//! runs in a fresh sandbox, so the notes live in `/memory`, a read-write directory the operator grants: one
//! file per key (hex-named, so any key is a safe file name), written to a temporary file and renamed, so a
//! crash or a concurrent call never leaves half a value.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use thorn_plugin_sdk::{Plugin, json};

/// Where the granted directory appears inside the sandbox.
pub const ROOT: &str = "/memory";
/// Most keys kept.
const MAX_KEYS: usize = 10_000;

/// Arguments of `remember`.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Remember {
    /// Name of the note.
    #[schemars(length(min = 1, max = 128))]
    pub key: String,
    /// The note.
    #[schemars(length(max = 65536))]
    pub value: String,
}

/// Arguments of `recall` and `forget`.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Key {
    /// Name of the note.
    #[schemars(length(min = 1, max = 128))]
    pub key: String,
}

/// Arguments of `list_keys`.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Prefix {
    /// Only keys that start with this text; empty (the default) lists every key.
    #[serde(default)]
    #[schemars(length(max = 128))]
    pub prefix: String,
}

/// A stored note.
#[derive(Serialize, Deserialize, JsonSchema)]
pub struct Note {
    /// Name of the note.
    pub key: String,
    /// The note, or null when there is none.
    pub value: Option<String>,
}

fn file_of(key: &str) -> PathBuf {
    let hex: String = key.bytes().map(|b| format!("{b:02x}")).collect();
    PathBuf::from(ROOT).join(format!("{hex}.json"))
}

fn key_of(name: &str) -> Option<String> {
    let hex = name.strip_suffix(".json")?;
    if hex.len() % 2 != 0 {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}

fn io(what: &str, e: std::io::Error) -> String {
    format!("{what}: {e} (is {ROOT} granted read-write?)")
}

/// Stores `value` under `key`, replacing what was there.
pub fn remember(a: Remember) -> Result<Note, String> {
    let file = file_of(&a.key);
    if !file.exists() && keys("")?.len() >= MAX_KEYS {
        return Err(format!(
            "the memory is full ({MAX_KEYS} keys); forget something first"
        ));
    }
    let tmp = file.with_extension("tmp");
    let text = serde_json::to_string(&Note {
        key: a.key.clone(),
        value: Some(a.value.clone()),
    })
    .map_err(|e| e.to_string())?;
    std::fs::write(&tmp, text).map_err(|e| io("cannot store the note", e))?;
    std::fs::rename(&tmp, &file).map_err(|e| io("cannot store the note", e))?;
    Ok(Note {
        key: a.key,
        value: Some(a.value),
    })
}

/// The note under `key` (value null when there is none).
pub fn recall(a: Key) -> Result<Note, String> {
    match std::fs::read_to_string(file_of(&a.key)) {
        Ok(t) => serde_json::from_str(&t).map_err(|e| format!("a stored note is damaged: {e}")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Note {
            key: a.key,
            value: None,
        }),
        Err(e) => Err(io("cannot read the note", e)),
    }
}

/// Deletes the note under `key`; returns whether there was one.
pub fn forget(a: Key) -> Result<bool, String> {
    match std::fs::remove_file(file_of(&a.key)) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io("cannot delete the note", e)),
    }
}

fn keys(prefix: &str) -> Result<Vec<String>, String> {
    let mut out: Vec<String> = std::fs::read_dir(ROOT)
        .map_err(|e| io("cannot list the notes", e))?
        .flatten()
        .filter_map(|e| key_of(&e.file_name().to_string_lossy()))
        .filter(|k| k.starts_with(prefix))
        .collect();
    out.sort();
    Ok(out)
}

/// The stored keys (sorted), optionally only those with a prefix.
pub fn list_keys(a: Prefix) -> Result<Vec<String>, String> {
    keys(&a.prefix)
}

thorn_plugin_sdk::plugin!(
    Plugin::new(
        "memory",
        "0.1.0",
        "A key-value memory that persists across calls and conversations."
    )
    .wants_dir(ROOT, "read-write")
    .function(
        "remember",
        "Remembers a note: stores (saves) a value under a key, replacing any previous one.",
        remember
    )
    .example(
        "Remember that my bike lock combination is 2468; use the key bike.",
        json!({"key": "bike", "value": "2468"})
    )
    .example(
        "Save \"Tuesday 10am\" as the note dentist.",
        json!({"key": "dentist", "value": "Tuesday 10am"})
    )
    .from_request(&["key", "value"])
    .answer("Remembered {{ result.key }}: {{ result.value }}")
    .destructive(true)
    .function(
        "recall",
        "Recalls the note (value) stored under a key, or null if there is none.",
        recall
    )
    .example("Look up my note called dentist.", json!({"key": "dentist"}))
    .example("What is the value of the key bike?", json!({"key": "bike"}))
    .from_request(&["key"])
    .answer(
        "{% if result.value is not none %}{{ result.key }}: {{ result.value }}{% else %}Nothing is stored under {{ arguments.key }}.{% endif %}"
    )
    .read_only()
    .function(
        "forget",
        "Forgets (deletes) the note under a key; returns whether one existed.",
        forget
    )
    .example("Remove the bike note from memory.", json!({"key": "bike"}))
    .example("Erase what you stored under dentist.", json!({"key": "dentist"}))
    .from_request(&["key"])
    .answer(
        "{% if result %}Forgot {{ arguments.key }}.{% else %}Nothing was stored under {{ arguments.key }}.{% endif %}"
    )
    .destructive(true)
    .function(
        "list_keys",
        "Lists the keys of the stored notes, optionally only those with a prefix.",
        list_keys
    )
    .example("What notes have you stored?", json!({"prefix": ""}))
    .example("Which notes do you remember?", json!({"prefix": ""}))
    .from_request(&["prefix"])
    .answer(
        "{% if result %}Stored keys: {{ result | join(', ') }}{% else %}No notes are stored{% if arguments.prefix %} under {{ arguments.prefix }}{% endif %}.{% endif %}"
    )
    .read_only()
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_through_file_names() {
        for k in ["a", "user/name", "ünïcode ✓", "../../etc"] {
            let f = file_of(k);
            assert_eq!(f.parent().unwrap(), std::path::Path::new(ROOT));
            let name = f.file_name().unwrap().to_string_lossy().into_owned();
            assert_eq!(key_of(&name).as_deref(), Some(k));
        }
        assert_eq!(key_of("zz.json"), None);
        assert_eq!(key_of("abc.json"), None);
        assert_eq!(key_of("6162.tmp"), None);
    }
}
