//! `thorn mcp`'s stdio: newline-delimited JSON-RPC, as rmcp's stdio transport reads it, except that a
//! line that is not JSON is answered as JSON-RPC says (`-32700`, parse error, `id` null) instead of being
//! dropped without a word, and a line longer than [`MAX_LINE`] is refused the same way without being
//! held whole. Lines that are JSON go to rmcp unchanged; rmcp's output and the parse errors share one
//! writer, so each reply is a whole line.

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;

/// The longest request line read (a tool call's arguments included).
pub const MAX_LINE: usize = 16 << 20;

/// The stdio transport for rmcp: what it reads (the JSON lines of stdin) and where it writes (stdout).
pub fn transport() -> (
    impl AsyncRead + Send + Unpin,
    impl AsyncWrite + Send + Unpin,
) {
    serve(tokio::io::stdin(), tokio::io::stdout())
}

/// [`transport`] over any input and output (tests use pipes).
pub fn serve(
    input: impl AsyncRead + Send + Unpin + 'static,
    output: impl AsyncWrite + Send + Unpin + 'static,
) -> (
    impl AsyncRead + Send + Unpin,
    impl AsyncWrite + Send + Unpin,
) {
    let (to_rmcp, rmcp_in) = tokio::io::duplex(64 << 10);
    let (rmcp_out, from_rmcp) = tokio::io::duplex(64 << 10);
    let (lines_tx, lines) = mpsc::channel::<Vec<u8>>(64);
    tokio::spawn(write_lines(output, lines));
    // rmcp's replies, line by line, to the shared writer.
    let replies = lines_tx.clone();
    tokio::spawn(async move {
        let mut r = BufReader::new(from_rmcp);
        let mut line = Vec::new();
        while r.read_until(b'\n', &mut line).await.is_ok_and(|n| n > 0) {
            if replies.send(std::mem::take(&mut line)).await.is_err() {
                break;
            }
        }
    });
    tokio::spawn(read_requests(input, to_rmcp, lines_tx));
    (rmcp_in, rmcp_out)
}

/// Writes each line whole, flushing after it.
async fn write_lines(mut out: impl AsyncWrite + Unpin, mut lines: mpsc::Receiver<Vec<u8>>) {
    while let Some(mut line) = lines.recv().await {
        if !line.ends_with(b"\n") {
            line.push(b'\n');
        }
        if out.write_all(&line).await.is_err() || out.flush().await.is_err() {
            break;
        }
    }
}

/// Reads request lines: JSON goes to rmcp, anything else is answered with a parse error.
async fn read_requests(
    input: impl AsyncRead + Unpin,
    mut to_rmcp: impl AsyncWrite + Unpin,
    errors: mpsc::Sender<Vec<u8>>,
) {
    let mut r = BufReader::new(input);
    let mut line = Vec::new();
    loop {
        line.clear();
        let (n, whole) = match read_line(&mut r, &mut line).await {
            Ok(x) => x,
            Err(_) => break,
        };
        if n == 0 {
            break;
        }
        let text = line.trim_ascii();
        if text.is_empty() && whole {
            continue;
        }
        let refused = if !whole {
            Some(format!(
                "Parse error: a request line longer than {MAX_LINE} bytes"
            ))
        } else {
            serde_json::from_slice::<serde_json::Value>(text)
                .err()
                .map(|e| format!("Parse error: {e}"))
        };
        match refused {
            Some(message) => {
                let reply = serde_json::json!({"jsonrpc": "2.0", "id": null,
                    "error": {"code": -32700, "message": message}});
                if errors.send(reply.to_string().into_bytes()).await.is_err() {
                    break;
                }
            }
            None => {
                let sent = to_rmcp.write_all(text).await.is_ok()
                    && to_rmcp.write_all(b"\n").await.is_ok()
                    && to_rmcp.flush().await.is_ok();
                if !sent {
                    break;
                }
            }
        }
    }
    // End of input: rmcp sees the end of its stream and stops.
    let _ = to_rmcp.shutdown().await;
}

/// Reads one line into `line` (at most [`MAX_LINE`] bytes of it kept; the rest of a longer one is read
/// and dropped): the bytes read, and whether the line fit.
async fn read_line(
    r: &mut (impl AsyncBufReadExt + Unpin),
    line: &mut Vec<u8>,
) -> std::io::Result<(usize, bool)> {
    let mut total = 0;
    let mut whole = true;
    loop {
        let buf = r.fill_buf().await?;
        if buf.is_empty() {
            return Ok((total, whole));
        }
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        if whole && line.len() + take <= MAX_LINE {
            line.extend_from_slice(&buf[..take]);
        } else {
            whole = false;
            line.clear();
        }
        r.consume(take);
        total += take;
        if done {
            return Ok((total, whole));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn json_lines_pass_and_anything_else_is_a_parse_error() {
        let (mut client, server_in) = tokio::io::duplex(1 << 16);
        let (server_out, mut replies) = tokio::io::duplex(1 << 16);
        let (mut rmcp_in, mut rmcp_out) = serve(server_in, server_out);
        client
            .write_all(b"not json\n{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}\n\n{\"a\":\n")
            .await
            .unwrap();
        // What rmcp reads: the JSON line only.
        let mut got = vec![0u8; 64];
        let n = rmcp_in.read(&mut got).await.unwrap();
        assert_eq!(
            &got[..n],
            b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}\n"
        );
        // What the client reads: a parse error per line that is not JSON, and rmcp's own replies.
        rmcp_out
            .write_all(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n")
            .await
            .unwrap();
        rmcp_out.flush().await.unwrap();
        drop(client);
        let mut text = String::new();
        let mut buf = vec![0u8; 4096];
        while text.lines().count() < 3 {
            let n = replies.read(&mut buf).await.unwrap();
            assert!(n > 0, "replies ended early: {text}");
            text.push_str(std::str::from_utf8(&buf[..n]).unwrap());
        }
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let errors: Vec<_> = lines
            .iter()
            .filter(|v| v["error"]["code"] == -32700)
            .collect();
        assert_eq!(errors.len(), 2, "{text}");
        assert!(errors.iter().all(|e| e["id"].is_null()));
        assert!(lines.iter().any(|v| v["result"].is_object()), "{text}");
        // The input ended: rmcp's stream ends too.
        let mut rest = Vec::new();
        rmcp_in.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
    }
}
