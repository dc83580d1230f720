//! The image server's access log: one line per request, written when its
//! response is finished (or abandoned), with the bytes actually sent. A
//! node's failed download is traced from it: who asked, for what range,
//! what it got and how long it took.

use axum::extract::Request;
use axum::http::header;
use std::net::SocketAddr;
use std::time::Instant;

/// The target access lines are logged under (`RUST_LOG` can select it).
pub const TARGET: &str = "ironic_image_worker::access";

/// How the image server logs its requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccessLog {
    /// Not at all.
    Off,
    /// The combined log format (as nginx and Apache write it), then the
    /// duration in seconds and the range asked for.
    Combined,
    /// One JSON log line with the fields as keys.
    Json,
}

/// The address of the client of a connection, put on each of its requests
/// by the listener.
#[derive(Debug, Clone, Copy)]
pub struct ClientAddr(pub SocketAddr);

/// One request being answered; logged when dropped (its body sent or
/// abandoned).
pub struct Entry {
    format: AccessLog,
    client: Option<SocketAddr>,
    method: String,
    path: String,
    version: &'static str,
    /// Header values as sent (not always UTF-8).
    range: Vec<u8>,
    user_agent: Vec<u8>,
    status: u16,
    /// Body bytes handed to the connection.
    pub bytes: u64,
    started: Instant,
}

impl Entry {
    /// Starts the entry of `req` (before it is answered); `None` when the
    /// access log is off.
    pub fn start(format: AccessLog, req: &Request) -> Option<Entry> {
        if format == AccessLog::Off {
            return None;
        }
        let header = |name| {
            req.headers()
                .get(name)
                .map_or_else(|| b"-".to_vec(), |v| v.as_bytes().to_vec())
        };
        Some(Entry {
            format,
            client: req.extensions().get::<ClientAddr>().map(|c| c.0),
            method: req.method().to_string(),
            path: req.uri().path().to_string(),
            version: match req.version() {
                axum::http::Version::HTTP_10 => "HTTP/1.0",
                _ => "HTTP/1.1",
            },
            range: header(header::RANGE),
            user_agent: header(header::USER_AGENT),
            status: 0,
            bytes: 0,
            started: Instant::now(),
        })
    }

    /// Records the status answered.
    pub fn answered(&mut self, status: u16) {
        self.status = status;
    }

    /// The line in the combined log format, with the duration (seconds)
    /// and the range asked for at the end; what the client chose is
    /// escaped ([`escaped`]).
    fn combined(&self) -> String {
        let client = self
            .client
            .map(|c| c.ip().to_string())
            .unwrap_or_else(|| "-".into());
        format!(
            "{client} - - [{}] \"{} {} {}\" {} {} \"-\" \"{}\" {:.3} range=\"{}\"",
            clf_time(std::time::SystemTime::now()),
            escaped(self.method.as_bytes()),
            escaped(self.path.as_bytes()),
            self.version,
            self.status,
            self.bytes,
            escaped(&self.user_agent),
            self.started.elapsed().as_secs_f64(),
            escaped(&self.range),
        )
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        match self.format {
            AccessLog::Off => {}
            AccessLog::Combined => tracing::info!(target: TARGET, "{}", self.combined()),
            AccessLog::Json => tracing::info!(
                target: TARGET,
                client = %self.client.map(|c| c.ip().to_string()).unwrap_or_default(),
                method = %self.method,
                path = %self.path,
                status = self.status,
                bytes = self.bytes,
                duration_ms = self.started.elapsed().as_millis() as u64,
                range = %String::from_utf8_lossy(&self.range),
                user_agent = %String::from_utf8_lossy(&self.user_agent),
                "access"
            ),
        }
    }
}

/// `bytes` as a field between quotes of a text line can hold it, as nginx
/// writes its access log: `"`, `\\`, control bytes and bytes beyond ASCII
/// as `\xHH`, so no client can end a field early, forge the fields after
/// it or break the line.
fn escaped(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for &b in bytes {
        if b == b'"' || b == b'\\' || !(0x20..0x7f).contains(&b) {
            out.push_str(&format!("\\x{b:02X}"));
        } else {
            out.push(char::from(b));
        }
    }
    out
}

/// `10/Oct/2000:13:55:36 +0000`, the combined log format's time, in UTC.
fn clf_time(at: std::time::SystemTime) -> String {
    // httpdate: "Tue, 10 Oct 2000 13:55:36 GMT".
    let http = httpdate::fmt_http_date(at);
    let parts: Vec<&str> = http.split(' ').collect();
    match parts.as_slice() {
        [_, day, month, year, time, _] => format!("{day}/{month}/{year}:{time} +0000"),
        _ => http,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn combined_log_format_with_duration_and_range() {
        let req = Request::builder()
            .method("GET")
            .uri("/agent_images/node?x=1")
            .header(header::RANGE, "bytes=0-99")
            .header(header::USER_AGENT, "curl/8")
            .body(axum::body::Body::empty())
            .unwrap();
        let mut req = req;
        req.extensions_mut()
            .insert(ClientAddr("192.0.2.5:4242".parse().unwrap()));
        let mut entry = Entry::start(AccessLog::Combined, &req).unwrap();
        entry.answered(206);
        entry.bytes = 100;
        let line = entry.combined();
        assert!(line.starts_with("192.0.2.5 - - ["), "{line}");
        assert!(
            line.contains("] \"GET /agent_images/node HTTP/1.1\" 206 100 \"-\" \"curl/8\" "),
            "{line}"
        );
        assert!(line.ends_with(" range=\"bytes=0-99\""), "{line}");
        assert!(Entry::start(AccessLog::Off, &req).is_none());
        std::mem::forget(entry);
    }

    /// A client's quote cannot end a field of the text line: `"`, `\\`,
    /// control bytes and bytes beyond ASCII are written `\xHH`, as nginx
    /// writes them.
    #[test]
    fn what_the_client_chose_is_escaped_as_nginx_escapes_it() {
        let mut req = Request::builder()
            .method("GET")
            .uri("/agent_images/a\"b")
            .header(header::RANGE, "bytes=0-1\" 200 5 \"-\" \"forged")
            .header(
                header::USER_AGENT,
                axum::http::HeaderValue::from_bytes(b"ua\\\t\xff").unwrap(),
            )
            .body(axum::body::Body::empty())
            .unwrap();
        req.extensions_mut()
            .insert(ClientAddr("192.0.2.5:4242".parse().unwrap()));
        let entry = Entry::start(AccessLog::Combined, &req).unwrap();
        let line = entry.combined();
        assert!(
            line.contains(
                "\"GET /agent_images/a\\x22b HTTP/1.1\" 0 0 \"-\" \"ua\\x5C\\x09\\xFF\" "
            ),
            "{line}"
        );
        assert!(
            line.ends_with(" range=\"bytes=0-1\\x22 200 5 \\x22-\\x22 \\x22forged\""),
            "{line}"
        );
        assert_eq!(line.matches('"').count(), 8, "{line}");
        std::mem::forget(entry);
    }

    #[test]
    fn clf_time_is_day_month_year_time_zone() {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(971_186_136);
        assert_eq!(clf_time(t), "10/Oct/2000:13:55:36 +0000");
    }
}
