//! Conversion to raw (and zstd decompression), hashed in the same pass.
//!
//! qcow2 is read with qcow2-rs in a child process of our own binary
//! (`convert-child`) under an address-space limit and a timeout: a panic,
//! crash or runaway on a hostile image becomes `corrupt_image` for that
//! request while the worker keeps serving. The child writes holes for zero
//! clusters and computes MD5/SHA-256 of the raw output as it writes it. Other
//! formats (and qcow2 features qcow2-rs lacks) go through `qemu-img convert`
//! with the source format always explicit.

use crate::error::{Error, ErrorCode, Result};
use crate::inspect::{Format, Inspection};
use crate::qcow2;
use crate::sink::{CHUNK, Digests, Sink};
use serde::{Deserialize, Serialize};
use std::io::Read;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

/// How conversions are run (`[convert]`).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Address-space limit of the converter process, bytes.
    pub memory: u64,
    /// Minimum time allowed for one conversion.
    pub min_timeout: Duration,
    /// Slowest acceptable conversion rate, bytes of virtual disk per second.
    pub min_rate: u64,
}

impl Limits {
    fn timeout(&self, virtual_size: u64) -> Duration {
        self.min_timeout + Duration::from_secs(virtual_size / self.min_rate.max(1))
    }
}

/// Whether a format must be converted when force_raw applies: raw and GPT
/// disks are raw already, and Ironic never converts an ISO.
pub fn needs_conversion(format: Format) -> bool {
    !format.is_raw() && format != Format::Iso
}

/// Size of the raw disk made from a qcow2 of `virtual_size` bytes: qemu
/// counts whole 512-byte sectors and drops a partial last one.
pub fn raw_size(virtual_size: u64) -> u64 {
    virtual_size / 512 * 512
}

/// What the child reports on stdout, one JSON object per line: progress
/// now and then, then the result.
#[derive(Debug, Serialize, Deserialize)]
#[serde(untagged)]
enum ChildReport {
    Progress { progress: u64 },
    Failed { code: ErrorCode, message: String },
    Done(Digests),
}

/// Converts `src` (already safety-checked, format `found`) to raw at the new
/// file `dst`, returning the digests of the raw bytes.
pub async fn to_raw(
    src: &Path,
    dst: &Path,
    found: &Inspection,
    header: Option<&qcow2::Header>,
    sha512: bool,
    limits: Limits,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Digests> {
    let timeout = limits.timeout(found.virtual_size);
    match (found.format, header) {
        (Format::Qcow2, Some(h)) if h.qcow2_rs_can_read() => {
            run_child(src, dst, sha512, None, limits, timeout, progress).await
        }
        (format, _) => qemu_img(src, dst, format, sha512, timeout).await,
    }
}

/// Converts the qcow2 `src` while it is still being downloaded: the
/// converter waits for each byte range it reads until the file has grown
/// past it (`total` bytes in the end). qemu-img writes metadata before the
/// data it maps, so conversion follows close behind the download; any other
/// layout only waits longer. The download must still be verified, and the
/// complete file checked, before the result is used (see `pipeline`); if the
/// file is removed or replaced (a failed or retried download), the converter
/// stops with an error.
pub async fn qcow2_to_raw_streaming(
    src: &Path,
    dst: &Path,
    total: u64,
    virtual_size: u64,
    sha512: bool,
    limits: Limits,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Digests> {
    let timeout = limits.timeout(virtual_size);
    run_child(src, dst, sha512, Some(total), limits, timeout, progress).await
}

async fn run_child(
    src: &Path,
    dst: &Path,
    sha512: bool,
    grow_to: Option<u64>,
    limits: Limits,
    timeout: Duration,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Digests> {
    let memory = limits.memory;
    let exe = "/proc/self/exe"; // the running binary, also after it was replaced on disk
    let mut cmd = tokio::process::Command::new(exe);
    cmd.arg("convert-child").arg(src).arg(dst);
    if sha512 {
        cmd.arg("--sha512");
    }
    if let Some(total) = grow_to {
        cmd.arg("--grow-to").arg(total.to_string());
    }
    cmd.env("MALLOC_ARENA_MAX", "2")
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            // rustix issues the system calls directly: no allocation, no lock.
            let lim = Some(memory);
            let lim = rustix::process::Rlimit {
                current: lim,
                maximum: lim,
            };
            let _ = rustix::process::setrlimit(rustix::process::Resource::As, lim);
            let _ = rustix::process::set_parent_process_death_signal(Some(
                rustix::process::Signal::KILL,
            ));
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|e| Error::io("start converter", e))?;
    let (Some(stdout), Some(mut stderr)) = (child.stdout.take(), child.stderr.take()) else {
        return Err(Error::new(ErrorCode::Internal, "converter pipes missing"));
    };
    let stderr_text = tokio::spawn(async move {
        let mut text = String::new();
        let _ = tokio::io::AsyncReadExt::read_to_string(&mut stderr, &mut text).await;
        text
    });
    let run = async {
        let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
        let mut report = None;
        while let Ok(Some(line)) = lines.next_line().await {
            match serde_json::from_str::<ChildReport>(&line) {
                Ok(ChildReport::Progress { progress: done }) => progress(done),
                Ok(other) => report = Some(other),
                Err(_) => {}
            }
        }
        (child.wait().await, report)
    };
    let (status, report) = match tokio::time::timeout(timeout, run).await {
        Ok((status, report)) => (status.map_err(|e| Error::io("converter", e))?, report),
        Err(_) => {
            let _ = std::fs::remove_file(dst);
            return Err(Error::new(
                ErrorCode::CorruptImage,
                format!("conversion did not finish within {timeout:?}"),
            ));
        }
    };
    match (status.success(), report) {
        (true, Some(ChildReport::Done(digests))) => Ok(digests),
        (_, Some(ChildReport::Failed { code, message })) => Err(Error::new(code, message)),
        _ => {
            use std::os::unix::process::ExitStatusExt;
            let stderr = stderr_text.await.unwrap_or_default();
            let tail: String = stderr.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
            let how = match status.signal() {
                Some(sig) => format!("killed by signal {sig}"),
                None => format!("exited with {status}"),
            };
            Err(Error::new(
                ErrorCode::CorruptImage,
                format!("qcow2 reader {how} on this image: {tail}"),
            ))
        }
    }
}

async fn qemu_img(
    src: &Path,
    dst: &Path,
    format: Format,
    sha512: bool,
    timeout: Duration,
) -> Result<Digests> {
    let run = tokio::process::Command::new("qemu-img")
        .args(["convert", "-q", "-f", format.name(), "-O", "raw"])
        .arg(src)
        .arg(dst)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output();
    let out = match tokio::time::timeout(timeout, run).await {
        Ok(out) => out.map_err(|e| Error::io("run qemu-img", e))?,
        Err(_) => {
            let _ = std::fs::remove_file(dst);
            return Err(Error::new(
                ErrorCode::CorruptImage,
                format!("qemu-img did not finish within {timeout:?}"),
            ));
        }
    };
    if !out.status.success() {
        let _ = std::fs::remove_file(dst);
        let msg = String::from_utf8_lossy(&out.stderr).trim().to_string();
        let code = if msg.contains("No space left") {
            ErrorCode::InsufficientDiskSpace
        } else {
            ErrorCode::CorruptImage
        };
        return Err(Error::new(code, format!("qemu-img convert: {msg}")));
    }
    crate::fsutil::set_mode(
        &std::fs::File::open(dst).map_err(|e| Error::io("open converted image", e))?,
        0o644,
    )?;
    hash_file(dst, sha512).await
}

/// Digests of an existing file, read once.
pub async fn hash_file(path: &Path, sha512: bool) -> Result<Digests> {
    let mut sink = Sink::hash_only(sha512);
    let mut file = tokio::fs::File::open(path)
        .await
        .map_err(|e| Error::io(path.display(), e))?;
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = tokio::io::AsyncReadExt::read(&mut file, &mut buf)
            .await
            .map_err(|e| Error::io(path.display(), e))?;
        if n == 0 {
            break;
        }
        sink.write(&buf[..n]).await?;
    }
    sink.finish().await
}

/// Decompresses the zstd file `src` into the new file `dst` (at most
/// `max_size` bytes), hashing the output in the same pass.
pub async fn decompress_zstd(
    src: &Path,
    dst: &Path,
    sha512: bool,
    max_size: u64,
) -> Result<Digests> {
    let mut sink = Sink::create(dst, sha512)?;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>>>(4);
    let src = src.to_path_buf();
    let reader = tokio::task::spawn_blocking(move || {
        let bad = |e: std::io::Error| Error::new(ErrorCode::CorruptImage, format!("zstd: {e}"));
        let file = std::fs::File::open(&src).map_err(|e| Error::io("open zstd image", e))?;
        let mut dec = zstd::stream::read::Decoder::new(file).map_err(bad)?;
        loop {
            let mut buf = vec![0u8; CHUNK];
            let mut filled = 0;
            while filled < buf.len() {
                match dec.read(&mut buf[filled..]).map_err(bad)? {
                    0 => break,
                    n => filled += n,
                }
            }
            if filled == 0 {
                return Ok(());
            }
            buf.truncate(filled);
            if tx.blocking_send(Ok(buf)).is_err() {
                return Ok(());
            }
        }
    });
    let mut result = Ok(());
    while let Some(chunk) = rx.recv().await {
        if let Err(e) = async { sink.write(&chunk?).await }.await {
            result = Err(e);
            break;
        }
        if sink.size() > max_size {
            result = Err(Error::new(
                ErrorCode::UnsafeImage,
                format!("zstd image expands beyond {max_size} bytes"),
            ));
            break;
        }
    }
    drop(rx);
    let read = reader
        .await
        .map_err(|e| Error::new(ErrorCode::Internal, format!("zstd task: {e}")))?;
    result?;
    read?;
    sink.finish().await
}

/// Body of the `convert-child` process: qcow2 -> raw with qcow2-rs, hashed
/// in the same pass. Prints one JSON report line; any panic or crash is seen
/// by the parent as a failed conversion.
pub fn child_main(
    src: &Path,
    dst: &Path,
    sha512: bool,
    grow_to: Option<u64>,
) -> std::process::ExitCode {
    let report = match child_convert(src, dst, sha512, grow_to) {
        Ok(d) => ChildReport::Done(d),
        Err(e) => {
            let _ = std::fs::remove_file(dst);
            ChildReport::Failed {
                code: e.code,
                message: e.message,
            }
        }
    };
    let failed = matches!(report, ChildReport::Failed { .. });
    println!("{}", serde_json::to_string(&report).unwrap_or_default());
    if failed {
        std::process::ExitCode::FAILURE
    } else {
        std::process::ExitCode::SUCCESS
    }
}

fn child_convert(src: &Path, dst: &Path, sha512: bool, grow_to: Option<u64>) -> Result<Digests> {
    match grow_to {
        None => {
            let params = qcow2_rs::dev::Qcow2DevParams::new(9, None, None, true, false);
            let dev = qcow2_rs::utils::qcow2_setup_dev_sync(src, &params)
                .map_err(|e| Error::new(ErrorCode::CorruptImage, format!("qcow2: {e}")))?;
            child_copy(dev, dst, sha512)
        }
        Some(total) => {
            let file = std::fs::File::open(src).map_err(|e| Error::io("open qcow2", e))?;
            let io = GrowingFile { file, total };
            let rt = current_thread()?;
            let params = qcow2_rs::dev::Qcow2DevParams::new(9, None, None, true, false);
            let dev = rt
                .block_on(qcow2_rs::utils::qcow2_alloc_dev(src, io, &params))
                .map_err(|e| Error::new(ErrorCode::CorruptImage, format!("qcow2: {e}")))?
                .0;
            child_copy(dev, dst, sha512)
        }
    }
}

fn current_thread() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io("converter runtime", e))
}

/// A qcow2 file still being written by the download: reads wait until the
/// file covers them (or reaches `total`), and fail if the file was unlinked
/// (the download failed or restarted on a new file).
struct GrowingFile {
    file: std::fs::File,
    total: u64,
}

impl qcow2_rs::ops::Qcow2IoOps for GrowingFile {
    async fn read_to(&self, offset: u64, buf: &mut [u8]) -> qcow2_rs::error::Qcow2Result<usize> {
        use std::os::unix::fs::{FileExt, MetadataExt};
        let want = (offset + buf.len() as u64).min(self.total);
        loop {
            let meta = self.file.metadata()?;
            if meta.len() >= want {
                break;
            }
            if meta.nlink() == 0 {
                return Err("the image being downloaded was removed".into());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64)? {
                0 => break,
                n => done += n,
            }
        }
        Ok(done)
    }

    async fn write_from(&self, _offset: u64, _buf: &[u8]) -> qcow2_rs::error::Qcow2Result<()> {
        Err("read-only".into())
    }

    async fn fallocate(
        &self,
        _offset: u64,
        _len: usize,
        _flags: u32,
    ) -> qcow2_rs::error::Qcow2Result<()> {
        Err("read-only".into())
    }

    async fn fsync(
        &self,
        _offset: u64,
        _len: usize,
        _flags: u32,
    ) -> qcow2_rs::error::Qcow2Result<()> {
        Ok(())
    }
}

/// Reads the whole virtual disk of `dev` in order into the new raw file
/// `dst`, hashing it on the way.
fn child_copy<T: qcow2_rs::ops::Qcow2IoOps>(
    dev: qcow2_rs::dev::Qcow2Dev<T>,
    dst: &Path,
    sha512: bool,
) -> Result<Digests> {
    const READ: usize = 4 << 20;
    let corrupt =
        |e: qcow2_rs::error::Qcow2Error| Error::new(ErrorCode::CorruptImage, format!("qcow2: {e}"));
    let rt = current_thread()?;
    rt.block_on(async {
        dev.qcow2_prep_io().await.map_err(corrupt)?;
        let virtual_size = raw_size(dev.info.virtual_size());
        let mut sink = Sink::create(dst, sha512)?;
        let mut buf = qcow2_rs::helpers::Qcow2IoBuf::<u8>::new(READ);
        let mut off = 0u64;
        let mut reported = std::time::Instant::now();
        while off < virtual_size {
            if reported.elapsed() >= Duration::from_secs(1) {
                reported = std::time::Instant::now();
                let line = serde_json::to_string(&ChildReport::Progress { progress: off });
                println!("{}", line.unwrap_or_default());
            }
            let left = virtual_size - off;
            let want = (left.min(READ as u64) as usize).div_ceil(512) * 512;
            let n = dev.read_at(&mut buf[..want], off).await.map_err(corrupt)?;
            let take = (n as u64).min(left) as usize;
            if take == 0 {
                return Err(Error::new(
                    ErrorCode::CorruptImage,
                    "qcow2: reader made no progress",
                ));
            }
            sink.write(&buf[..take]).await?;
            off += take as u64;
        }
        sink.finish().await
    })
}
