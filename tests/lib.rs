//! Shared helpers for thorn's end-to-end tests: where the model and fixtures are, and golden files.

use std::path::{Path, PathBuf};

pub mod sigstore;

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_owned()
}

/// `tests/data/<rel>`: the committed test data (see its README).
pub fn fixture(rel: &str) -> PathBuf {
    root().join("tests/data").join(rel)
}

/// Lines of a JSONL fixture.
pub fn jsonl(rel: &str) -> Vec<serde_json::Value> {
    jsonl_at(&fixture(rel))
}

/// The rows of the recorded agent conversations that `thorn bench agentic` replays (`crates/bench/data/trajectories`).
pub fn trajectories() -> Vec<serde_json::Value> {
    jsonl_at(&root().join("crates/bench/data/trajectories/agentic_coding_2.5h.jsonl"))
}

fn jsonl_at(path: &Path) -> Vec<serde_json::Value> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("fixture line is JSON"))
        .collect()
}

/// The index of the largest logit (the first, on ties).
pub fn argmax(x: &[f32]) -> u32 {
    x.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0 as u32
}

/// The default model, pulled by `thorn model pull` (CI does that before the tests).
pub fn default_model() -> PathBuf {
    let cache = thorn::store::cache_dir(None);
    thorn::store::default_model(&cache).unwrap_or_else(|e| {
        panic!("{e}\nThe end-to-end tests need the default model: run `cargo run --release -- model pull`.")
    })
}

/// The Python interpreter that has the pinned real clients (`tests/clients/requirements.txt`):
/// `THORN_TEST_PYTHON`, else `target/pyclients/bin/python` (`scripts/test` installs it). `None`, with a line
/// saying the client test is skipped, when there is none; with `THORN_REQUIRE_PYCLIENTS=1` (CI) a missing
/// interpreter fails the test instead.
pub fn client_python() -> Option<PathBuf> {
    let found = std::env::var_os("THORN_TEST_PYTHON")
        .map(PathBuf::from)
        .or_else(|| Some(root().join("target/pyclients/bin/python")))
        .filter(|p| p.exists());
    if found.is_none() {
        assert!(
            std::env::var_os("THORN_REQUIRE_PYCLIENTS").is_none_or(|v| v != "1"),
            "THORN_REQUIRE_PYCLIENTS=1 but no client interpreter: run scripts/test, which installs \
             tests/clients/requirements.txt into target/pyclients"
        );
        eprintln!("skip: the real-client test (no target/pyclients: scripts/test installs it)");
    }
    found
}

/// The `thorn` binary of this build (`target/<profile>/thorn`, beside the test executable's `deps/`).
/// `scripts/test` builds it before the tests run; a missing one fails with what to do.
pub fn thorn_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("thorn"))
        .expect("target/<profile>/");
    assert!(
        bin.is_file(),
        "{} is missing: run scripts/test, or `cargo build -p thorn` before `cargo test`",
        bin.display()
    );
    bin
}

/// A `thorn serve` process on a free loopback port, killed when dropped. Its stderr is collected (and
/// printed by [`ServeProcess::log`] for a failing test).
pub struct ServeProcess {
    child: std::process::Child,
    /// Where it listens.
    pub addr: std::net::SocketAddr,
    log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl ServeProcess {
    /// Starts `thorn serve --port 0 ARGS` with the default model, one thread and no speculation, and
    /// waits until it listens.
    pub fn start(args: &[&str]) -> Self {
        use std::io::BufRead;
        let model = default_model();
        let mut child = std::process::Command::new(thorn_binary())
            .args([
                "serve",
                "--port",
                "0",
                "--threads",
                "1",
                "--speculation",
                "off",
            ])
            .arg("--model")
            .arg(&model)
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start thorn serve");
        let stderr = child.stderr.take().expect("piped stderr");
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = std::sync::Arc::clone(&log);
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                // Kept before the address is announced: what `start` returns has its line in the log.
                {
                    let mut l = sink.lock().unwrap_or_else(|e| e.into_inner());
                    l.push_str(&line);
                    l.push('\n');
                }
                if let Some(rest) = line.split("serving the OpenAI API on ").nth(1) {
                    let rest = rest
                        .trim_start_matches("http://")
                        .trim_start_matches("https://");
                    let addr = rest.split_whitespace().next().unwrap_or("").to_owned();
                    let _ = tx.send(addr);
                }
            }
        });
        // Generous: loading the model and compiling plugins on a loaded machine.
        let addr = rx
            .recv_timeout(std::time::Duration::from_secs(300))
            .unwrap_or_else(|_| {
                let _ = child.kill();
                panic!("thorn serve did not start:\n{}", log.lock().unwrap())
            });
        ServeProcess {
            child,
            addr: addr.parse().expect("a socket address"),
            log,
        }
    }

    /// Sends it a signal (`STOP`, `CONT`, `KILL`): an upstream that hangs or dies, for the tests.
    pub fn signal(&self, sig: &str) {
        let ok = std::process::Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{sig} failed");
    }

    /// Waits up to `within` for it to exit on its own: its status, `None` while it still runs.
    pub fn wait(&mut self, within: std::time::Duration) -> Option<std::process::ExitStatus> {
        let t0 = std::time::Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if t0.elapsed() > within {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// What it has written to stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Drop for ServeProcess {
    /// Stops it as ctrl-c does, so it stops what it started (external MCP servers); killed if it has
    /// not exited within 20 s.
    fn drop(&mut self) {
        // Already gone (a test stopped it): nothing to signal.
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        let _ = std::process::Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status();
        let t0 = std::time::Instant::now();
        while t0.elapsed() < std::time::Duration::from_secs(20) {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A SHA-256 digest in hex (API key files and policies pin digests).
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Runs `tests/clients/<script>` with the client interpreter and `args`; its stdout parsed as JSON.
pub fn run_client(python: &Path, script: &str, args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(python)
        .arg(root().join("tests/clients").join(script))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {script}: {e}"));
    assert!(
        out.status.success(),
        "{script} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{script} printed no JSON ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// Compares `actual` with `tests/golden/<name>`; with `BLESS=1` rewrites the file instead.
pub fn golden(name: &str, actual: &str) {
    let path = root().join("tests/golden").join(name);
    if std::env::var_os("BLESS").is_some_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().expect("golden dir")).expect("create golden dir");
        std::fs::write(&path, actual).expect("write golden");
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "reading golden {}: {e} (BLESS=1 creates it)",
            path.display()
        )
    });
    if want != actual {
        let diff: Vec<String> = want
            .lines()
            .zip(actual.lines())
            .enumerate()
            .filter(|(_, (w, a))| w != a)
            .take(10)
            .map(|(i, (w, a))| format!("line {}:\n  want: {w}\n  got:  {a}", i + 1))
            .collect();
        panic!(
            "{} differs from the output ({} vs {} lines); BLESS=1 rewrites it\n{}",
            path.display(),
            want.lines().count(),
            actual.lines().count(),
            diff.join("\n")
        );
    }
}

/// The prompts of the SmolLM2 reference fixtures, as token ids.
pub fn fixture_prompts() -> Vec<Vec<u32>> {
    jsonl("smollm2/reference_logits.jsonl")
        .iter()
        .map(|p| token_ids(&p["prompt_ids"]))
        .collect()
}

/// A JSON array of token ids.
pub fn token_ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("an array of token ids")
        .iter()
        .map(|x| x.as_u64().expect("a token id") as u32)
        .collect()
}

/// A test plugin component built by `tests/build.rs` (`calculator`, `hostile`, ...).
pub fn plugin_wasm(name: &str) -> PathBuf {
    let p = Path::new(env!("THORN_TEST_PLUGINS")).join(format!("{name}.wasm"));
    assert!(p.is_file(), "{} was not built", p.display());
    p
}

/// Copies the test plugins `names` into `installed` and returns the policy's `plugins` entries: each pinned
/// by its sha256, with the fields `grants(name)` gives (an object) added.
pub fn install_plugins(
    host: &thorn_plugin::PluginHost,
    installed: &Path,
    names: &[&str],
    grants: impl Fn(&str) -> serde_json::Value,
) -> serde_json::Map<String, serde_json::Value> {
    let mut entries = serde_json::Map::new();
    for name in names {
        let wasm = plugin_wasm(name);
        std::fs::copy(&wasm, installed.join(format!("{name}.wasm"))).expect("copy a test plugin");
        let sha = host
            .open(&wasm)
            .expect("open a test plugin")
            .sha256()
            .to_owned();
        let mut entry = serde_json::json!({ "sha256": sha });
        if let (Some(e), serde_json::Value::Object(g)) = (entry.as_object_mut(), grants(name)) {
            e.extend(g);
        }
        entries.insert((*name).into(), entry);
    }
    entries
}

/// What the hostile test plugin asks for, granted (`data` as its `/data`), with a 300 ms deadline.
pub fn hostile_grants(data: &Path) -> serde_json::Value {
    serde_json::json!({"filesystem": [{"guest": "/data", "host": data, "access": "read"}],
        "env": {"THORN_TEST_VAR": "x"}, "network": ["127.0.0.1:*"], "limits": {"timeout_ms": 300}})
}

/// A request sampled at temperature 1.0 with `seed`, for at most `max` tokens.
pub fn sampled(prompt: Vec<u32>, seed: u64, max: usize) -> thorn_engine::engine::Request {
    thorn_engine::engine::Request {
        sampling: thorn_engine::sample::SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..thorn_engine::sample::SamplingParams::default()
        },
        ..thorn_engine::engine::Request::greedy(prompt, max)
    }
}

/// A response read off the wire by [`http`].
#[derive(Debug, Clone)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Headers, names lowercased.
    pub headers: Vec<(String, String)>,
    /// The body (de-chunked).
    pub body: String,
}

impl HttpResponse {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// The `data:` payloads of a server-sent-events body.
    pub fn sse(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
            .map(str::to_owned)
            .collect()
    }
}

/// Writes an HTTP/1.1 request (the connection closes after it).
pub fn http_send(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::net::TcpStream {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the test server");
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        && !body.is_empty()
    {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).expect("write request head");
    // A server may answer (413) and close before reading a large body; that is not an error here.
    let _ = s.write_all(body);
    s
}

/// One request, the whole response.
pub fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> HttpResponse {
    use std::io::Read;
    let mut s = http_send(addr, method, path, headers, body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    parse_http(&raw)
}

/// Reads a whole response (until the server closes) off a stream from [`http_send`].
pub fn read_http(s: &mut std::net::TcpStream) -> HttpResponse {
    use std::io::Read;
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    parse_http(&raw)
}

fn parse_http(raw: &[u8]) -> HttpResponse {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP head in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut rest = &raw[split + 4..];
    let mut lines = head.lines();
    let status: u16 = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        let mut out = Vec::new();
        while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
            let size = String::from_utf8_lossy(&rest[..eol]);
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            let data = &rest[eol + 2..];
            if n == 0 || data.len() < n {
                out.extend_from_slice(&data[..n.min(data.len())]);
                break;
            }
            out.extend_from_slice(&data[..n]);
            rest = data[n..].strip_prefix(b"\r\n").unwrap_or(&data[n..]);
        }
        out
    } else {
        rest.to_vec()
    };
    HttpResponse {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// A certificate authority made for a test, and server certificates it signs (for `localhost` and
/// `127.0.0.1`), written as PEM files.
pub struct TestCa {
    issuer: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    /// The CA's certificate file, for a client to trust.
    pub cert: PathBuf,
}

impl TestCa {
    /// A new CA, its certificate written to `dir/<name>.pem`.
    pub fn new(dir: &Path, name: &str) -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, format!("thorn test CA {name}"));
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let key = rcgen::KeyPair::generate().expect("CA key");
        let issuer = rcgen::CertifiedIssuer::self_signed(params, key).expect("CA certificate");
        let cert = dir.join(format!("{name}.pem"));
        std::fs::write(&cert, issuer.pem()).expect("write the CA");
        TestCa { issuer, cert }
    }

    /// A server certificate and its key, signed by this CA: `dir/<name>.pem`, `dir/<name>.key`.
    pub fn issue(&self, dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let params =
            rcgen::CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
                .expect("server params");
        let key = rcgen::KeyPair::generate().expect("server key");
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        let (c, k) = (
            dir.join(format!("{name}.pem")),
            dir.join(format!("{name}.key")),
        );
        std::fs::write(&c, cert.pem()).expect("write the certificate");
        std::fs::write(&k, key.serialize_pem()).expect("write the key");
        (c, k)
    }
}

/// Sends `thorn serve` at `addr` a chat request that forces one call of the host tool `tool` (a
/// `thorn:` name) for the user message `content`, one round, greedy; asserts a 200 and returns the
/// answer's message (its `thorn_host_tool_calls` hold the call and its result).
pub fn forced_host_call(
    addr: std::net::SocketAddr,
    tool: &str,
    content: &str,
) -> serde_json::Value {
    let body = serde_json::json!({"messages": [{"role": "user", "content": content}],
        "tools": [{"type": "function", "function": {"name": tool}}],
        "tool_choice": "required", "temperature": 0, "max_tokens": 64, "max_tool_rounds": 1});
    let r = http(
        addr,
        "POST",
        "/v1/chat/completions",
        &[],
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["choices"][0]["message"].clone()
}
