//! The file reader/searcher tool: lists, reads and searches text files under `/data`, the one directory it
//! asks for (read-only). The operator's policy maps `/data` to a host directory; the sandbox makes anything
//! outside it unreachable, and the tool also refuses absolute paths and `..` so its errors are clear.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::path::{Component, Path, PathBuf};
use thorn_plugin_sdk::{Plugin, json};

/// Where the granted directory appears inside the sandbox.
pub const ROOT: &str = "/data";
/// Largest slice `read` returns.
const MAX_READ: usize = 64 << 10;
/// Files larger than this are skipped by `search`.
const MAX_SEARCH_FILE: u64 = 4 << 20;

fn default_dot() -> String {
    ".".into()
}

/// Arguments of `list`.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct List {
    /// A directory in the workspace, relative to its root; `.` (the default) is the whole workspace.
    #[serde(default = "default_dot")]
    #[schemars(length(max = 1024))]
    pub path: String,
}

/// One directory entry.
#[derive(Serialize, JsonSchema)]
pub struct Entry {
    /// File or directory name.
    pub name: String,
    /// `file`, `dir` or `other`.
    pub kind: String,
    /// Size in bytes (files).
    pub size: u64,
}

/// Arguments of `read`.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Read {
    /// A file, relative to the granted root.
    #[schemars(length(min = 1, max = 1024))]
    pub path: String,
    /// Byte offset to start at.
    #[serde(default)]
    pub offset: u64,
    /// Most bytes to return (at most 65536).
    #[serde(default)]
    #[schemars(range(min = 1, max = 65536))]
    pub max_bytes: Option<u32>,
}

/// A slice of a file.
#[derive(Serialize, JsonSchema)]
pub struct Text {
    /// The file.
    pub path: String,
    /// Its size in bytes.
    pub size: u64,
    /// The text read (invalid UTF-8 replaced).
    pub content: String,
    /// Whether the file goes on past this slice.
    pub truncated: bool,
}

/// Arguments of `search`.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Search {
    /// Text to look for (case-insensitive).
    #[schemars(length(min = 1, max = 256))]
    pub query: String,
    /// Directory to search, relative to the granted root.
    #[serde(default = "default_dot")]
    #[schemars(length(max = 1024))]
    pub path: String,
    /// Most matches to return.
    #[serde(default)]
    #[schemars(range(min = 1, max = 500))]
    pub max_results: Option<u32>,
}

/// One matching line.
#[derive(Serialize, JsonSchema)]
pub struct Hit {
    /// The file, relative to the granted root.
    pub path: String,
    /// Line number (from 1).
    pub line: u32,
    /// The line (cut at 300 characters).
    pub text: String,
}

/// The matches of a search.
#[derive(Serialize, JsonSchema)]
pub struct Hits {
    /// Matching lines, in path order.
    pub matches: Vec<Hit>,
    /// Whether the search stopped at `max_results`.
    pub truncated: bool,
}

/// `rel` resolved under [`ROOT`], refusing absolute paths and `..`.
fn resolve(rel: &str) -> Result<PathBuf, String> {
    let p = Path::new(rel);
    let mut out = PathBuf::from(ROOT);
    for c in p.components() {
        match c {
            Component::Normal(s) => out.push(s),
            Component::CurDir => {}
            Component::ParentDir => return Err(format!("{rel:?}: `..` is not allowed")),
            Component::RootDir | Component::Prefix(_) => {
                return Err(format!(
                    "{rel:?}: paths are relative to the granted directory"
                ));
            }
        }
    }
    Ok(out)
}

fn shown(p: &Path) -> String {
    p.strip_prefix(ROOT)
        .map(|r| r.display().to_string())
        .unwrap_or_else(|_| p.display().to_string())
}

/// Lists a directory.
pub fn list(a: List) -> Result<Vec<Entry>, String> {
    let dir = resolve(&a.path)?;
    let rd = std::fs::read_dir(&dir).map_err(|e| format!("cannot list {:?}: {e}", a.path))?;
    let mut out = Vec::new();
    for e in rd.flatten() {
        let meta = e.metadata().ok();
        let kind = match &meta {
            Some(m) if m.is_dir() => "dir",
            Some(m) if m.is_file() => "file",
            _ => "other",
        };
        out.push(Entry {
            name: e.file_name().to_string_lossy().into_owned(),
            kind: kind.into(),
            size: meta.filter(|m| m.is_file()).map_or(0, |m| m.len()),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Reads a slice of a file.
pub fn read(a: Read) -> Result<Text, String> {
    use std::io::{Read as _, Seek, SeekFrom};
    let path = resolve(&a.path)?;
    let mut f = std::fs::File::open(&path).map_err(|e| format!("cannot read {:?}: {e}", a.path))?;
    let size = f.metadata().map_err(|e| e.to_string())?.len();
    let want = a.max_bytes.map_or(MAX_READ, |n| (n as usize).min(MAX_READ));
    f.seek(SeekFrom::Start(a.offset.min(size)))
        .map_err(|e| e.to_string())?;
    let mut buf = Vec::with_capacity(want);
    f.take(want as u64)
        .read_to_end(&mut buf)
        .map_err(|e| format!("cannot read {:?}: {e}", a.path))?;
    let end = a.offset.min(size) + buf.len() as u64;
    Ok(Text {
        path: shown(&path),
        size,
        content: String::from_utf8_lossy(&buf).into_owned(),
        truncated: end < size,
    })
}

/// Searches the text files under a directory, depth first in name order.
pub fn search(a: Search) -> Result<Hits, String> {
    let root = resolve(&a.path)?;
    let limit = a.max_results.unwrap_or(50) as usize;
    let needle = a.query.to_lowercase();
    let mut hits = Hits {
        matches: Vec::new(),
        truncated: false,
    };
    let mut stack = vec![root];
    let mut visited = 0usize;
    while let Some(p) = stack.pop() {
        visited += 1;
        if visited > 100_000 {
            return Err("too many files under that directory".into());
        }
        let Ok(meta) = std::fs::metadata(&p) else {
            continue;
        };
        if meta.is_dir() {
            let mut names: Vec<PathBuf> = std::fs::read_dir(&p)
                .map_err(|e| format!("cannot list {}: {e}", shown(&p)))?
                .flatten()
                .map(|e| e.path())
                .collect();
            names.sort();
            stack.extend(names.into_iter().rev());
            continue;
        }
        if !meta.is_file() || meta.len() > MAX_SEARCH_FILE {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&p) else {
            continue; // not UTF-8 text
        };
        for (i, line) in text.lines().enumerate() {
            if line.to_lowercase().contains(&needle) {
                if hits.matches.len() == limit {
                    hits.truncated = true;
                    return Ok(hits);
                }
                hits.matches.push(Hit {
                    path: shown(&p),
                    line: i as u32 + 1,
                    text: line.chars().take(300).collect(),
                });
            }
        }
    }
    Ok(hits)
}

thorn_plugin_sdk::plugin!(
    Plugin::new(
        "files",
        "0.1.0",
        "Lists, reads and searches the text files of one directory the operator has granted (read-only)."
    )
    .wants_dir(ROOT, "read")
    .function("list_files", "Lists the files and folders in a directory of the workspace.", list)
    .example("What is in the notes folder?", json!({"path": "notes"}))
    .example("What files do you have?", json!({"path": "."}))
    .from_request(&["path"])
    .answer(
        "{% for f in result %}{{ f.name }}{% if f.kind == 'dir' %}/{% endif %}{% if not loop.last %}, {% endif %}{% else %}{{ arguments.path }} is empty.{% endfor %}"
    )
    .read_only()
    .function("read_file", "Reads the text of a file in the workspace (or a slice of a large one).", read)
    .example("Show me the contents of todo.txt.", json!({"path": "todo.txt"}))
    .example("Print notes/plan.md.", json!({"path": "notes/plan.md"}))
    .from_request(&["path"])
    .answer("{{ result.path }}:\n{{ result.content }}{% if result.truncated %} …{% endif %}")
    .read_only()
    .function(
        "search_files",
        "Searches the workspace's files for a word or text and finds the lines that contain it (case-insensitive).",
        search
    )
    .example("Which files mention \"invoice\"?", json!({"query": "invoice"}))
    .example("Find where the word budget appears.", json!({"query": "budget"}))
    .from_request(&["query", "path"])
    .answer(
        "{% for m in result.matches %}{{ m.path }}:{{ m.line }}: {{ m.text }}\n{% else %}No line contains \"{{ arguments.query }}\".{% endfor %}"
    )
    .read_only()
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_stay_under_the_root() {
        assert_eq!(
            resolve("a/./b.txt").unwrap(),
            PathBuf::from("/data/a/b.txt")
        );
        assert_eq!(resolve(".").unwrap(), PathBuf::from("/data"));
        assert!(resolve("../etc/passwd").unwrap_err().contains(".."));
        assert!(resolve("a/../../x").is_err());
        assert!(resolve("/etc/passwd").unwrap_err().contains("relative"));
    }
}
