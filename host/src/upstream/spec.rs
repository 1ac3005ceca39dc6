//! What the operator says of an upstream: `--upstream NAME=URL[,OPTION=VALUE...]`.
//!
//! `NAME` is `[a-z][a-z0-9-]*` (at most 32 bytes): it names the upstream in model ids (`NAME/MODEL`),
//! errors, metrics and the audit of routing. `URL` is the engine's OpenAI base (`http://host:8000/v1`, or `https://` verified against the system's roots and `--tls-ca`;
//! a URL without a path gets `/v1`). The options:
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `key_env=VAR` / `key_file=PATH` | none | the bearer token sent upstream (never logged) |
//! | `models=a\|b` | discovered | the models served (else `GET /models` at start and at each health check) |
//! | `connect_timeout=5s` | 5 s | TCP connect |
//! | `timeout=60s` | 60 s | until the upstream's response starts |
//! | `idle_timeout=60s` | 60 s | most silence between two stream events (a hung upstream) |
//! | `max_concurrent=16` | 16 | requests in flight to it (more get 503) |
//! | `max_response=32M` | 32 MiB | most bytes of one response (an upstream that ignores `max_tokens`) |
//! | `health_interval=10s` | 10 s | between health checks (`0`: none) |
//! | `failures=3` | 3 | consecutive failures that open the circuit |
//! | `cooldown=30s` | 30 s | how long an open circuit refuses requests before it tries one |
//!
//! Durations take humantime's forms (`500ms`, `30s`, `2m`) or plain seconds.

use std::path::PathBuf;
use std::time::Duration;
use thiserror::Error;

/// A malformed `--upstream`.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("--upstream {spec:?}: {why}")]
pub struct SpecError {
    /// The spec as given (without its key, which a spec never holds).
    pub spec: String,
    /// What is wrong.
    pub why: String,
}

/// Where the upstream's bearer token comes from.
#[derive(Clone, PartialEq, Eq)]
pub enum KeySource {
    /// An environment variable of thorn's.
    Env(String),
    /// A file (its contents, trimmed).
    File(PathBuf),
}

impl std::fmt::Debug for KeySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeySource::Env(v) => write!(f, "env:{v}"),
            KeySource::File(p) => write!(f, "file:{}", p.display()),
        }
    }
}

/// One upstream engine, as configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamSpec {
    /// Its name.
    pub name: String,
    /// The OpenAI base URL, without a trailing `/` (`http://host:8000/v1`).
    pub base: String,
    /// Its bearer token's source.
    pub key: Option<KeySource>,
    /// The models it serves, when pinned (else discovered).
    pub models: Vec<String>,
    /// TCP connect limit.
    pub connect_timeout: Duration,
    /// Limit until the response starts.
    pub timeout: Duration,
    /// Most silence between stream events.
    pub idle_timeout: Duration,
    /// Most requests in flight.
    pub max_concurrent: usize,
    /// Most bytes of one response.
    pub max_response: usize,
    /// Between health checks (zero: none).
    pub health_interval: Duration,
    /// Consecutive failures that open the circuit.
    pub failures: u32,
    /// How long an open circuit stays open.
    pub cooldown: Duration,
}

/// The longest name.
const MAX_NAME: usize = 32;

fn valid_name(n: &str) -> bool {
    let mut b = n.bytes();
    n.len() <= MAX_NAME
        && b.next().is_some_and(|c| c.is_ascii_lowercase())
        && b.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
}

fn duration(v: &str) -> Result<Duration, String> {
    if let Ok(secs) = v.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    humantime::parse_duration(v).map_err(|e| format!("{v:?} is not a duration ({e})"))
}

fn bytes(v: &str) -> Result<usize, String> {
    let (num, mult) = match v.as_bytes().last() {
        Some(b'K' | b'k') => (&v[..v.len() - 1], 1usize << 10),
        Some(b'M' | b'm') => (&v[..v.len() - 1], 1 << 20),
        Some(b'G' | b'g') => (&v[..v.len() - 1], 1 << 30),
        _ => (v, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("{v:?} is not a size (like 32M)"))
}

impl UpstreamSpec {
    /// Parses `NAME=URL[,OPTION=VALUE...]`.
    pub fn parse(spec: &str) -> Result<Self, SpecError> {
        let err = |why: String| SpecError {
            spec: spec.to_owned(),
            why,
        };
        let (name, rest) = spec
            .split_once('=')
            .ok_or_else(|| err("expected NAME=URL[,OPTION=VALUE...]".into()))?;
        if !valid_name(name) {
            return Err(err(format!(
                "the name {name:?} must be [a-z][a-z0-9-]*, at most {MAX_NAME} bytes"
            )));
        }
        let mut parts = rest.split(',');
        let url = parts.next().unwrap_or("").trim();
        let base = Self::base_of(url).map_err(err)?;
        let mut s = UpstreamSpec {
            name: name.to_owned(),
            base,
            key: None,
            models: Vec::new(),
            connect_timeout: Duration::from_secs(5),
            timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(60),
            max_concurrent: 16,
            max_response: 32 << 20,
            health_interval: Duration::from_secs(10),
            failures: 3,
            cooldown: Duration::from_secs(30),
        };
        for part in parts {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| err(format!("the option {part:?} is not OPTION=VALUE")))?;
            let v = v.trim();
            let positive = |d: Duration| {
                if d.is_zero() {
                    Err(format!("{k} must be more than 0"))
                } else {
                    Ok(d)
                }
            };
            match k.trim() {
                "key_env" if !v.is_empty() => s.key = Some(KeySource::Env(v.to_owned())),
                "key_file" if !v.is_empty() => s.key = Some(KeySource::File(v.into())),
                "models" => {
                    s.models = v
                        .split('|')
                        .map(str::trim)
                        .filter(|m| !m.is_empty())
                        .map(str::to_owned)
                        .collect();
                    if let Some(m) = s.models.iter().find(|m| !super::valid_model_id(m)) {
                        return Err(err(format!("the model id {m:?} is not a valid id")));
                    }
                }
                "connect_timeout" => {
                    s.connect_timeout = duration(v).and_then(positive).map_err(err)?
                }
                "timeout" => s.timeout = duration(v).and_then(positive).map_err(err)?,
                "idle_timeout" => s.idle_timeout = duration(v).and_then(positive).map_err(err)?,
                "health_interval" => s.health_interval = duration(v).map_err(err)?,
                "cooldown" => s.cooldown = duration(v).map_err(err)?,
                "max_response" => s.max_response = bytes(v).map_err(err)?,
                "max_concurrent" => {
                    s.max_concurrent =
                        v.parse().ok().filter(|&n: &usize| n > 0).ok_or_else(|| {
                            err(format!("max_concurrent {v:?} is not a count above 0"))
                        })?
                }
                "failures" => {
                    s.failures = v
                        .parse()
                        .ok()
                        .filter(|&n: &u32| n > 0)
                        .ok_or_else(|| err(format!("failures {v:?} is not a count above 0")))?
                }
                other => {
                    return Err(err(format!(
                        "unknown option {other:?} (key_env, key_file, models, connect_timeout, timeout, idle_timeout, max_concurrent, max_response, health_interval, failures, cooldown)"
                    )));
                }
            }
        }
        Ok(s)
    }

    /// The base URL: `http[s]://host[:port][/path]`, a bare authority getting `/v1`. An https upstream
    /// is verified against the system's roots and `--tls-ca`.
    fn base_of(url: &str) -> Result<String, String> {
        let Some((scheme, rest)) = url
            .strip_prefix("http://")
            .map(|r| ("http", r))
            .or_else(|| url.strip_prefix("https://").map(|r| ("https", r)))
        else {
            return Err(format!("{url:?} is not an http:// or https:// URL"));
        };
        let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        if authority.is_empty() || authority.contains(['@', '?', '#', ' ']) {
            return Err(format!(
                "{url:?}: expected {scheme}://HOST[:PORT][/PATH] (no user info, query or fragment)"
            ));
        }
        if path.contains(['?', '#', ' ']) {
            return Err(format!(
                "{url:?}: the path may not hold a query or fragment"
            ));
        }
        let path = path.trim_end_matches('/');
        let path = if path.is_empty() { "/v1" } else { path };
        Ok(format!("{scheme}://{authority}{path}"))
    }

    /// Reads the bearer token (at start: a missing variable or file is an error then, not at the first
    /// request).
    pub fn read_key(&self) -> Result<Option<String>, SpecError> {
        let err = |why: String| SpecError {
            spec: format!("{}=...", self.name),
            why,
        };
        let key = match &self.key {
            None => return Ok(None),
            Some(KeySource::Env(var)) => {
                std::env::var(var).map_err(|_| err(format!("key_env: ${var} is not set")))?
            }
            Some(KeySource::File(p)) => std::fs::read_to_string(p)
                .map_err(|e| err(format!("key_file {}: {e}", p.display())))?,
        };
        let key = key.trim().to_owned();
        if key.is_empty() || key.bytes().any(|b| !(0x21..0x7f).contains(&b)) {
            return Err(err(
                "the key is empty or holds characters a header cannot carry".into(),
            ));
        }
        Ok(Some(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_with_their_defaults_and_options() {
        let s = UpstreamSpec::parse("big=http://10.0.0.2:8000").unwrap();
        assert_eq!(s.name, "big");
        assert_eq!(s.base, "http://10.0.0.2:8000/v1");
        let tls = UpstreamSpec::parse("big=https://gpu.example:8443").unwrap();
        assert_eq!(tls.base, "https://gpu.example:8443/v1");
        assert_eq!(s.timeout, Duration::from_secs(60));
        assert_eq!(s.max_concurrent, 16);
        assert!(s.models.is_empty() && s.key.is_none());

        let s = UpstreamSpec::parse(
            "gpu-2=http://h/openai/v1/,key_env=BIG_KEY,models=Qwen/Qwen3-8B|small,timeout=500ms,idle_timeout=2,max_concurrent=4,max_response=1M,health_interval=0,failures=2,cooldown=1m",
        )
        .unwrap();
        assert_eq!(s.base, "http://h/openai/v1");
        assert_eq!(s.key, Some(KeySource::Env("BIG_KEY".into())));
        assert_eq!(s.models, ["Qwen/Qwen3-8B", "small"]);
        assert_eq!(s.timeout, Duration::from_millis(500));
        assert_eq!(s.idle_timeout, Duration::from_secs(2));
        assert_eq!(
            (s.max_concurrent, s.max_response, s.failures),
            (4, 1 << 20, 2)
        );
        assert!(s.health_interval.is_zero());
        assert_eq!(s.cooldown, Duration::from_secs(60));
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        let why = |s: &str| UpstreamSpec::parse(s).unwrap_err().why;
        assert!(why("big").contains("NAME=URL"));
        assert!(why("Big=http://h").contains("[a-z]"));
        assert!(why("big=ftp://h").contains("not an http:// or https:// URL"));
        assert!(why("big=https://u@h").contains("expected https://HOST"));
        assert!(why("big=http://user:pw@h").contains("no user info"));
        assert!(why("big=http://h,timeout=0").contains("more than 0"));
        assert!(why("big=http://h,timeout=soon").contains("not a duration"));
        assert!(why("big=http://h,max_concurrent=0").contains("above 0"));
        assert!(why("big=http://h,colour=blue").contains("unknown option"));
        assert!(why("big=http://h,models=a b").contains("not a valid id"));
    }

    #[test]
    fn keys_are_read_at_start_and_never_printed() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("key");
        std::fs::write(&file, "sk-secret\n").unwrap();
        let s = UpstreamSpec::parse(&format!("big=http://h,key_file={}", file.display())).unwrap();
        assert_eq!(s.read_key().unwrap().as_deref(), Some("sk-secret"));
        assert!(!format!("{s:?}").contains("sk-secret"));
        std::fs::write(&file, "two words").unwrap();
        assert!(s.read_key().is_err());
        let s = UpstreamSpec::parse("big=http://h,key_env=THORN_TEST_SURELY_UNSET").unwrap();
        assert!(s.read_key().unwrap_err().why.contains("not set"));
    }
}
