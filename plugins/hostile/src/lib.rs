//! A plugin whose functions misbehave on purpose, for the host's sandbox tests: spin forever, allocate
//! forever, recurse forever, panic, read files it was not given, escape a preopen with `..`, open a socket,
//! flood stdout, return a huge, non-JSON or non-UTF-8 result, return a huge error, hoard file descriptors,
//! look up names it was not granted, plant a symbolic link, and sleep past its deadline. It asks for `/data`
//! (read), one env var and loopback TCP, so the tests also show what a grant does and does not open. `ok` is a normal function,
//! to show the host still serves afterwards.

use schemars::JsonSchema;
use serde::Deserialize;
use thorn_plugin_sdk::{Plugin, schema_of};

/// Arguments for every function (most ignore them).
#[derive(Deserialize, JsonSchema, Default)]
pub struct Args {
    /// A path or an address.
    #[serde(default)]
    pub target: String,
    /// A size or a duration in milliseconds.
    #[serde(default)]
    pub n: u64,
}

fn spin(_: Args) -> Result<u64, String> {
    let mut x = 0u64;
    loop {
        x = std::hint::black_box(x.wrapping_add(1));
    }
}

fn alloc(_: Args) -> Result<usize, String> {
    let mut keep: Vec<Vec<u8>> = Vec::new();
    loop {
        keep.push(vec![1u8; 1 << 20]);
        std::hint::black_box(&keep);
    }
}

fn recurse(a: Args) -> Result<u64, String> {
    #[expect(unconditional_recursion, reason = "unbounded recursion is the point")]
    fn down(n: u64) -> u64 {
        std::hint::black_box(down(std::hint::black_box(n + 1)) + 1)
    }
    Ok(down(a.n))
}

fn panic(_: Args) -> Result<u64, String> {
    panic!("the hostile plugin panicked on purpose")
}

fn read(a: Args) -> Result<String, String> {
    std::fs::read_to_string(&a.target).map_err(|e| format!("cannot read {}: {e}", a.target))
}

fn connect(a: Args) -> Result<String, String> {
    std::net::TcpStream::connect(&a.target)
        .map(|_| "connected".to_owned())
        .map_err(|e| format!("cannot connect to {}: {e}", a.target))
}

fn flood(a: Args) -> Result<u64, String> {
    use std::io::Write;
    let chunk = vec![b'x'; 1 << 16];
    let mut out = std::io::stdout();
    let mut written = 0u64;
    while written < a.n.max(1) {
        out.write_all(&chunk).map_err(|e| format!("stdout: {e}"))?;
        written += chunk.len() as u64;
    }
    Ok(written)
}

fn huge(a: Args) -> Result<String, String> {
    Ok("y".repeat(a.n as usize))
}

fn sleep(a: Args) -> Result<u64, String> {
    std::thread::sleep(std::time::Duration::from_millis(a.n));
    Ok(a.n)
}

fn garbage(_: &str) -> Result<String, String> {
    Ok("{\"this is\": not JSON".into())
}

fn bad_utf8(_: &str) -> Result<String, String> {
    let bytes = vec![b'"', 0xff, 0xfe, b'"'];
    // SAFETY: not safe at all, on purpose: the host must reject a string that is not UTF-8 when it lifts it.
    Ok(unsafe { String::from_utf8_unchecked(bytes) })
}

fn env(a: Args) -> Result<String, String> {
    std::env::var(&a.target).map_err(|e| format!("no env var {}: {e}", a.target))
}

fn error_flood(a: Args) -> Result<u64, String> {
    Err("e".repeat(a.n as usize))
}

/// Opens `target` again and again, keeping every handle, until an open fails; returns how many it held.
fn fd_hoard(a: Args) -> Result<u64, String> {
    let mut held = Vec::new();
    loop {
        match std::fs::File::open(&a.target) {
            Ok(f) => held.push(f),
            Err(e) => return Err(format!("open #{} failed: {e}", held.len() + 1)),
        }
        if held.len() as u64 >= a.n.max(1) {
            return Ok(held.len() as u64);
        }
    }
}

/// Connects to `target` again and again, keeping every connection, until one fails; returns how many.
fn socket_hoard(a: Args) -> Result<u64, String> {
    let mut held = Vec::new();
    loop {
        match std::net::TcpStream::connect(&a.target) {
            Ok(s) => held.push(s),
            Err(e) => return Err(format!("connect #{} failed: {e}", held.len() + 1)),
        }
        if held.len() as u64 >= a.n.max(1) {
            return Ok(held.len() as u64);
        }
    }
}

fn lookup(a: Args) -> Result<Vec<String>, String> {
    use std::net::ToSocketAddrs;
    (a.target.as_str(), 0)
        .to_socket_addrs()
        .map(|it| it.map(|s| s.ip().to_string()).collect())
        .map_err(|e| format!("cannot resolve {}: {e}", a.target))
}

/// Creates the symbolic link `target` (`link=original`).
fn symlink(a: Args) -> Result<String, String> {
    let (link, original) = a.target.split_once('=').ok_or("target is link=original")?;
    #[expect(deprecated, reason = "the one stable way to make a symlink on WASI")]
    std::fs::soft_link(original, link).map_err(|e| format!("cannot link {link}: {e}"))?;
    Ok("linked".into())
}

fn ok(a: Args) -> Result<u64, String> {
    Ok(a.n + 1)
}

thorn_plugin_sdk::plugin!(
    Plugin::new("hostile", "0.1.0", "Misbehaves on purpose (tests only).")
        .wants_dir("/data", "read")
        .wants_env("THORN_TEST_VAR")
        .wants_network("127.0.0.1:*")
        .function("spin", "Loops forever.", spin)
        .function("alloc", "Allocates memory forever.", alloc)
        .function("recurse", "Recurses without end.", recurse)
        .function("panic", "Panics.", panic)
        .function("read", "Reads a file.", read)
        .function("connect", "Opens a TCP connection.", connect)
        .function("flood", "Writes n bytes to stdout.", flood)
        .function("huge", "Returns n bytes.", huge)
        .function("sleep", "Sleeps n milliseconds.", sleep)
        .function("env", "Reads an environment variable.", env)
        .function(
            "error_flood",
            "Fails with an n-byte error message.",
            error_flood
        )
        .function(
            "fd_hoard",
            "Opens a file up to n times, keeping every handle.",
            fd_hoard
        )
        .function(
            "socket_hoard",
            "Opens up to n TCP connections, keeping every one.",
            socket_hoard
        )
        .function("lookup", "Resolves a host name.", lookup)
        .function(
            "symlink",
            "Creates a symbolic link (target is link=original).",
            symlink
        )
        .raw_function(
            "garbage",
            "Returns text that is not JSON.",
            schema_of::<Args>(),
            garbage
        )
        .raw_function(
            "bad_utf8",
            "Returns bytes that are not UTF-8.",
            schema_of::<Args>(),
            bad_utf8
        )
        .function("ok", "Returns n + 1.", ok)
);
