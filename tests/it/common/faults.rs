//! Faults on purpose: a source server that misbehaves by path, and a
//! small file system that fills up or turns read-only.

use super::*;

/// A raw HTTP server for fault injection, serving files of `dir` by name:
/// `/slow/NAME` at `rate` bytes/s, `/stall/NAME` stops after half the body
/// and holds the connection, `/short/NAME` closes after half the body
/// (Content-Length says more), `/reset/NAME` resets the connection after
/// half the body, `/nolength/NAME` sends it without a Content-Length,
/// `/trickle/NAME` sends a byte every 100 ms, `/endless/ANY` streams without
/// a length for ever, `/redirect/TARGET` answers 302 to TARGET,
/// `/switch/NAME` sends other bytes on the first attempt (see there).
/// Counts requests per path.
pub struct FaultServer {
    pub addr: SocketAddr,
    counts: Arc<Mutex<HashMap<String, usize>>>,
}

impl FaultServer {
    pub async fn start(dir: &Path, rate: usize) -> FaultServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counts: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let (dir, c) = (dir.to_path_buf(), counts.clone());
        tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                let (dir, c) = (dir.clone(), c.clone());
                tokio::spawn(async move {
                    let _ = serve_fault(sock, &dir, rate, &c).await;
                });
            }
        });
        FaultServer { addr, counts }
    }

    pub fn url(&self, mode: &str, name: &str) -> String {
        format!("http://{}/{mode}/{name}", self.addr)
    }

    pub fn count(&self, mode: &str, name: &str) -> usize {
        *self
            .counts
            .lock()
            .unwrap()
            .get(&format!("/{mode}/{name}"))
            .unwrap_or(&0)
    }
}

async fn serve_fault(
    mut sock: tokio::net::TcpStream,
    dir: &Path,
    rate: usize,
    counts: &Mutex<HashMap<String, usize>>,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut req = Vec::new();
    let mut buf = [0u8; 1024];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = sock.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        req.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&req).to_string();
    let mut words = text.split_whitespace();
    let (method, path) = (
        words.next().unwrap_or(""),
        words.next().unwrap_or("").to_string(),
    );
    *counts.lock().unwrap().entry(path.clone()).or_default() += 1;
    let mut parts = path.trim_start_matches('/').splitn(2, '/');
    let (mode, name) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    // `/redirect/TARGET` answers 302 to TARGET (taken verbatim).
    if mode == "redirect" {
        let head = format!(
            "HTTP/1.1 302 Found\r\nLocation: {name}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        sock.write_all(head.as_bytes()).await?;
        return Ok(());
    }
    // `/endless/NAME` streams text without a Content-Length, for ever.
    if mode == "endless" {
        sock.write_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
            .await?;
        if method == "HEAD" {
            return Ok(());
        }
        let line = [b'0'; 64 * 1024];
        loop {
            sock.write_all(&line).await?;
        }
    }
    // `/switch/NAME`: the first request gets `NAME.first` (announced with
    // the length of `NAME`, then reset), every later one `NAME` itself: a
    // source whose first, failed attempt sent other bytes than its retry.
    let first_of_switch = mode == "switch" && counts.lock().unwrap()[&path] == 1;
    let file = if first_of_switch {
        format!("{name}.first")
    } else {
        name.to_string()
    };
    let Ok(data) = std::fs::read(dir.join(&file)) else {
        sock.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .await?;
        return Ok(());
    };
    // Last-Modified from the file itself, as a real server would answer.
    let modified = std::fs::metadata(dir.join(name))
        .and_then(|m| m.modified())
        .map(httpdate::fmt_http_date)?;
    let announced = match first_of_switch {
        true => std::fs::metadata(dir.join(name))?.len() as usize,
        false => data.len(),
    };
    let length = if mode == "nolength" {
        String::new()
    } else {
        format!("Content-Length: {announced}\r\n")
    };
    let head = format!(
        "HTTP/1.1 200 OK\r\n{length}Last-Modified: {modified}\r\nConnection: close\r\n\r\n"
    );
    sock.write_all(head.as_bytes()).await?;
    if method == "HEAD" {
        return Ok(());
    }
    let half = data.len() / 2;
    match mode {
        "slow" => {
            for chunk in data.chunks(rate.max(1) / 10 + 1) {
                sock.write_all(chunk).await?;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        "stall" => {
            sock.write_all(&data[..half]).await?;
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        // One byte every 100 ms (Content-Length announced).
        "trickle" => {
            for byte in &data {
                sock.write_all(std::slice::from_ref(byte)).await?;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        "short" => sock.write_all(&data[..half]).await?,
        // All of `NAME.first` (shorter than the announced length), padded
        // to one byte short of it, then a reset.
        "switch" if first_of_switch => {
            sock.write_all(&data).await?;
            let pad = vec![0x5au8; announced.saturating_sub(data.len() + 1)];
            sock.write_all(&pad).await?;
            sock.set_zero_linger()?;
        }
        "reset" => {
            sock.write_all(&data[..half]).await?;
            sock.set_zero_linger()?;
        }
        _ => sock.write_all(&data).await?,
    }
    Ok(())
}

/// A tmpfs of `size` mounted over a test directory (needs root, as CI has),
/// unmounted when dropped: a real file system that fills up or turns
/// read-only.
pub struct Tmpfs(PathBuf);

impl Tmpfs {
    pub fn mount(dir: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        let out = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size}"),
                "tmpfs",
                dir.to_str().unwrap(),
            ])
            .output();
        match out {
            Ok(out) if out.status.success() => Tmpfs(dir.to_path_buf()),
            Ok(out) => panic!(
                "cannot mount a tmpfs (this test needs root, as CI has): {}",
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => panic!("cannot mount a tmpfs (this test needs root, as CI has): {e}"),
        }
    }

    /// The `serve` flags that put every directory the worker writes (the
    /// master cache, the nodes' files, the HTTP root) on this file system.
    pub fn worker_flags(&self) -> Vec<String> {
        let dir = self.0.display();
        [
            format!("pxe.instance_master_path={dir}/master"),
            format!("pxe.images_path={dir}/images"),
            format!("deploy.http_root={dir}/httpboot"),
        ]
        .into_iter()
        .flat_map(|set| ["--set".to_string(), set])
        .collect()
    }

    /// `mount -o remount,<mode>`, e.g. `ro` or `rw`.
    pub fn remount(&self, mode: &str) {
        tool(
            "mount",
            &["-o", &format!("remount,{mode}"), self.0.to_str().unwrap()],
        );
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}
