//! Conversion to raw (and zstd decompression), hashed in the same pass.
//!
//! qcow2 is read by our own code (the tables `qcow2` validated, compressed
//! clusters decoded by `inflate` exactly as qemu decodes them) in a child
//! process of our own binary (`convert-child`) under an address-space limit
//! and a timeout: a panic, crash or runaway on a hostile image becomes
//! `corrupt_image` for that request while the worker keeps serving. The
//! child decodes compressed clusters on every core (`clusters`), writes
//! holes for zero clusters and computes MD5/SHA-256 of the raw output as it
//! writes it, in guest order. Other formats (and qcow2 images with extended L2
//! entries) go through `qemu-img convert` with the source format always
//! explicit.

use crate::error::{Error, ErrorCode, Result};
use crate::image::clusters::Output;
use crate::image::growing::GrowingFile;
use crate::image::inspect::Inspection;
use crate::image::qcow2;
use crate::image::reclaim::Reclaimer;
use crate::image::reports::{ChildReport, report};
use crate::image_format::Format;
/// Which digests a conversion computes; named here for the converter
/// child's command line, which knows the image layer and not the store.
pub use crate::store::sink::Served;
use crate::store::sink::{BlockingSink, CHUNK, Digests, Pace, Plan, Sink};
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

/// Size of the raw disk made from a qcow2 of `virtual_size` bytes: qemu
/// counts whole 512-byte sectors and drops a partial last one.
pub fn raw_size(virtual_size: u64) -> u64 {
    virtual_size / 512 * 512
}

/// Converts `src` (already safety-checked, format `found`) to raw at the new
/// file `dst`, returning the digests of the raw bytes.
pub async fn to_raw(
    src: &Path,
    dst: &Path,
    found: &Inspection,
    header: Option<&qcow2::Header>,
    served: Served,
    limits: Limits,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Digests> {
    let timeout = limits.timeout(found.virtual_size);
    match (found.format, header) {
        (Format::Qcow2, Some(h)) if h.converter_reads() => {
            run_child(src, dst, served, None, limits, timeout, progress, None)
                .await
                .map_err(StreamFailure::into_error)
        }
        (format, _) => qemu_img(src, dst, format, served, timeout).await,
    }
}

/// Converts the qcow2 `src` while it is still being downloaded: the
/// converter waits for each byte range it reads until the file has grown
/// past it (`total` bytes in the end). qemu-img writes metadata before the
/// data it maps, so conversion follows close behind the download; any other
/// layout only waits longer. The download must still be verified, and the
/// complete file checked, before the result is used (see `pipeline`); if the
/// file is removed or replaced (a failed or retried download), the converter
/// stops with an error. Where it reads is told to `pace` (the download's
/// writer keeps close behind it).
#[allow(clippy::too_many_arguments)]
pub async fn qcow2_to_raw_streaming(
    src: &Path,
    dst: &Path,
    total: u64,
    virtual_size: u64,
    served: Served,
    limits: Limits,
    progress: &(dyn Fn(u64) + Sync),
    pace: &Pace,
) -> Result<Digests, StreamFailure> {
    let timeout = limits.timeout(virtual_size);
    let grow = Some(total);
    run_child(
        src,
        dst,
        served,
        grow,
        limits,
        timeout,
        progress,
        Some(pace),
    )
    .await
}

/// How a conversion failed, for the caller that could convert again.
#[derive(Debug)]
pub enum StreamFailure {
    /// The converter exceeded its limits (time, memory) or crashed:
    /// converting the same bytes again would do the same, so the error
    /// stands at once.
    Conclusive(Error),
    /// Anything else (the file it read was replaced by a retried download,
    /// the layout needs the whole file...): converting the complete file may
    /// still work.
    Retryable(Error),
}

impl StreamFailure {
    /// The error, whatever kind.
    pub fn into_error(self) -> Error {
        match self {
            StreamFailure::Conclusive(e) | StreamFailure::Retryable(e) => e,
        }
    }
}

impl From<Error> for StreamFailure {
    fn from(e: Error) -> Self {
        StreamFailure::Retryable(e)
    }
}

#[allow(clippy::too_many_arguments)]
async fn run_child(
    src: &Path,
    dst: &Path,
    served: Served,
    grow_to: Option<u64>,
    limits: Limits,
    timeout: Duration,
    progress: &(dyn Fn(u64) + Sync),
    pace: Option<&Pace>,
) -> Result<Digests, StreamFailure> {
    let mut cmd = child_command(src, dst, served, grow_to, limits.memory);
    let mut child = cmd.spawn().map_err(|e| Error::io("start converter", e))?;
    let (Some(stdout), Some(mut stderr)) = (child.stdout.take(), child.stderr.take()) else {
        return Err(Error::new(ErrorCode::Internal, "converter pipes missing").into());
    };
    let stderr_text = tokio::spawn(async move {
        let mut text = String::new();
        let _ = tokio::io::AsyncReadExt::read_to_string(&mut stderr, &mut text).await;
        text
    });
    let run = async {
        let report = read_reports(stdout, progress, pace).await;
        (child.wait().await, report)
    };
    let (status, report) = match tokio::time::timeout(timeout, run).await {
        Ok((status, report)) => (status.map_err(|e| Error::io("converter", e))?, report),
        Err(_) => {
            let _ = std::fs::remove_file(dst);
            return Err(StreamFailure::Conclusive(Error::new(
                ErrorCode::CorruptImage,
                format!(
                    "conversion did not finish within {}s ([convert] min_timeout, min_rate_mib)",
                    timeout.as_secs()
                ),
            )));
        }
    };
    match (status.success(), report) {
        (true, Some(ChildReport::Done(digests))) => Ok(digests),
        (
            _,
            Some(ChildReport::Failed {
                code,
                message,
                conclusive,
            }),
        ) => {
            let e = Error::new(code, message);
            Err(if conclusive {
                StreamFailure::Conclusive(e)
            } else {
                StreamFailure::Retryable(e)
            })
        }
        _ => {
            let _ = std::fs::remove_file(dst);
            Err(StreamFailure::Conclusive(child_died(
                status,
                stderr_text.await.unwrap_or_default(),
            )))
        }
    }
}

/// The converter child: this binary (from `/proc/self/exe`, the running
/// one also after it was replaced on disk) under an address-space limit and
/// killed when the worker dies.
fn child_command(
    src: &Path,
    dst: &Path,
    served: Served,
    grow_to: Option<u64>,
    memory: u64,
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new("/proc/self/exe");
    cmd.arg("convert-child").arg(src).arg(dst);
    if served.sha512 {
        cmd.arg("--sha512");
    }
    if !served.md5 {
        cmd.arg("--no-md5");
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
    cmd
}

/// Follows the child's report lines: progress and the download pace as they
/// come, and its last verdict (done or failed), if it gave one.
async fn read_reports(
    stdout: tokio::process::ChildStdout,
    progress: &(dyn Fn(u64) + Sync),
    pace: Option<&Pace>,
) -> Option<ChildReport> {
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let mut report = None;
    while let Ok(Some(line)) = lines.next_line().await {
        match serde_json::from_str::<ChildReport>(&line) {
            Ok(ChildReport::Progress { progress: done }) => progress(done),
            Ok(ChildReport::Source { source }) => {
                if let Some(pace) = pace {
                    pace.reader_at(source);
                }
            }
            Ok(ChildReport::Waiting { .. }) => {
                if let Some(pace) = pace {
                    pace.reader_waiting();
                }
            }
            Ok(other) => report = Some(other),
            Err(_) => {}
        }
    }
    report
}

/// A child that died without a verdict (a crash, a signal, the memory
/// limit) on this image: `corrupt_image`, with the end of what it printed.
fn child_died(status: std::process::ExitStatus, stderr: String) -> Error {
    use std::os::unix::process::ExitStatusExt;
    let tail: String = stderr.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
    let how = match status.signal() {
        Some(sig) => format!("killed by signal {sig}"),
        None => format!("exited with {status}"),
    };
    Error::new(
        ErrorCode::CorruptImage,
        format!("qcow2 reader {how} on this image: {tail}"),
    )
}

async fn qemu_img(
    src: &Path,
    dst: &Path,
    format: Format,
    served: Served,
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
        // qemu-img exits 1 for every failure; a full disk is told by the
        // file system itself, measured before the partial output is removed.
        let full = disk_full_at(dst);
        let _ = std::fs::remove_file(dst);
        let msg = String::from_utf8_lossy(&out.stderr).trim().to_string();
        let code = if full {
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
    hash_file(dst, served).await
}

/// Free space below which a failed write is taken for a full disk: qemu-img
/// writes in pieces of at most a few MiB.
const FULL_DISK_SLACK: u64 = 16 << 20;

/// True when the file system holding `path` has (almost) no space left for
/// this process.
fn disk_full_at(path: &Path) -> bool {
    let dir = path.parent().unwrap_or(Path::new("."));
    crate::fsutil::free_space(dir).is_ok_and(|free| free < FULL_DISK_SLACK)
}

/// Digests of an existing file, read once: its holes (found with
/// `SEEK_HOLE`/`SEEK_DATA`) are hashed as zeros without being read, so a
/// sparse result of qemu-img costs what its data costs to read.
pub async fn hash_file(path: &Path, served: Served) -> Result<Digests> {
    enum Part {
        Data(Vec<u8>),
        Zeros(u64),
    }
    let mut sink = Sink::hash_only(served);
    let file = std::fs::File::open(path).map_err(|e| Error::io(path.display(), e))?;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Part>>(4);
    let shown = path.display().to_string();
    let reader = tokio::task::spawn_blocking(move || {
        use rustix::fs::{SeekFrom, seek};
        use std::os::unix::fs::FileExt;
        let send = |part| tx.blocking_send(part).is_ok();
        let fail = |e: std::io::Error| Err(Error::io(&shown, e));
        let len = match file.metadata() {
            Ok(m) => m.len(),
            Err(e) => return send(fail(e)),
        };
        let mut pos = 0u64;
        while pos < len {
            // Where the next data starts (the end when only a hole is left;
            // a file system without SEEK_DATA reports all data).
            let data = match seek(&file, SeekFrom::Data(pos)) {
                Ok(at) => at.min(len),
                Err(rustix::io::Errno::NXIO) => len,
                Err(_) => pos,
            };
            if data > pos && !send(Ok(Part::Zeros(data - pos))) {
                return false;
            }
            pos = data;
            let hole = match seek(&file, SeekFrom::Hole(pos)) {
                Ok(at) => at.min(len),
                Err(_) => len,
            };
            while pos < hole {
                let mut buf = vec![0u8; (hole - pos).min(CHUNK as u64) as usize];
                match file.read_at(&mut buf, pos) {
                    Ok(0) => return send(fail(std::io::ErrorKind::UnexpectedEof.into())),
                    Ok(n) => {
                        buf.truncate(n);
                        pos += n as u64;
                        if !send(Ok(Part::Data(buf))) {
                            return false;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return send(fail(e)),
                }
            }
        }
        true
    });
    let mut result = Ok(());
    while let Some(part) = rx.recv().await {
        let step = match part {
            Ok(Part::Data(buf)) => sink.write(&buf).await,
            Ok(Part::Zeros(n)) => sink.write_zeros(n).await,
            Err(e) => Err(e),
        };
        if let Err(e) = step {
            result = Err(e);
            break;
        }
    }
    drop(rx);
    let _ = reader.await;
    finish_or_abandon(sink, result).await
}

/// What an output of unannounced length asks before it grows further: the
/// room it may take on the file system is the caller's to decide, as for
/// any file whose length nobody announced.
pub trait Growth: Send {
    /// The output is now `size` bytes; an error stops it.
    fn grown_to(&mut self, size: u64) -> futures_util::future::BoxFuture<'_, Result<()>>;
}

/// Decompresses the zstd file `src` into the new file `dst` (at most
/// `max_size` bytes), hashing the output in the same pass; `growth` hears
/// the output's size after each write.
pub async fn decompress_zstd(
    src: &Path,
    dst: &Path,
    served: Served,
    max_size: u64,
    growth: &mut dyn Growth,
) -> Result<Digests> {
    let mut sink = Sink::create(dst, Plan::served(served))?;
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
        if let Err(e) = growth.grown_to(sink.size()).await {
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
        .map_err(|e| Error::new(ErrorCode::Internal, format!("zstd task: {e}")))
        .and_then(|read| read);
    finish_or_abandon(sink, result.and(read)).await
}

/// Finishes the sink after a pass that succeeded; after one that failed,
/// abandons it and waits until its file is closed, so that the caller's
/// removal of the partial output gives its space back at once (a dropped
/// sink would keep writing for a while).
async fn finish_or_abandon(sink: Sink, pass: Result<()>) -> Result<Digests> {
    match pass {
        Ok(()) => sink.finish().await,
        Err(e) => {
            sink.abandon().await;
            Err(e)
        }
    }
}

/// Body of the `convert-child` process: qcow2 -> raw by our own reader (tables checked by `qcow2`, compressed clusters by `inflate`), hashed
/// in the same pass. Prints one JSON report line; any panic or crash is seen
/// by the parent as a failed conversion.
pub fn child_main(
    src: &Path,
    dst: &Path,
    served: Served,
    grow_to: Option<u64>,
) -> std::process::ExitCode {
    let mut punched = false;
    let report = match child_convert(src, dst, served, grow_to, &mut punched) {
        Ok(d) => ChildReport::Done(d),
        Err(e) => {
            let _ = std::fs::remove_file(dst);
            ChildReport::Failed {
                code: e.code,
                message: e.message,
                conclusive: punched,
            }
        }
    };
    let failed = matches!(report, ChildReport::Failed { .. });
    self::report(&report);
    if failed {
        std::process::ExitCode::FAILURE
    } else {
        std::process::ExitCode::SUCCESS
    }
}

fn child_convert(
    src: &Path,
    dst: &Path,
    served: Served,
    grow_to: Option<u64>,
    punched: &mut bool,
) -> Result<Digests> {
    let file = std::fs::File::open(src).map_err(|e| Error::io("open qcow2", e))?;
    let total = match grow_to {
        Some(total) => total,
        None => file
            .metadata()
            .map_err(|e| Error::io("stat qcow2", e))?
            .len(),
    };
    let grows = grow_to.is_some();
    let tables = GrowingFile::new(file, total, grows);
    let map = Map::read(&tables)?;
    // Only a download being converted is given back as it is read.
    let mut reclaim = Reclaimer::new(&tables.file, &map.header, &map.l1, grows);
    let done = child_copy(dst, served, &map, &tables, &mut reclaim);
    *punched = grows && reclaim.spoiled();
    done
}

/// The header and L1 table of the image being converted, read by our own
/// code: they tell which guest ranges can hold data at all, so unallocated
/// and zero ranges become holes without being read (a 1 TiB disk with a
/// few MiB of data costs the reading of those MiB, plus hashing zeros).
struct Map {
    header: qcow2::Header,
    l1: Vec<u8>,
}

impl Map {
    fn read(file: &GrowingFile) -> Result<Map> {
        let head_len = (crate::image::inspect::HEADER_LEN as u64).min(file.total) as usize;
        let mut head = vec![0u8; head_len];
        file.read_waiting(0, &mut head)?;
        let limits = qcow2::Limits {
            max_virtual_size: u64::MAX,
        };
        let header = qcow2::parse(&head, file.total, limits)?;
        if !header.converter_reads() {
            return Err(Error::new(
                ErrorCode::Internal,
                "qcow2 features this converter does not read",
            ));
        }
        let mut l1 = vec![0u8; header.l1_size as usize * 8];
        file.read_waiting(header.l1_table_offset, &mut l1)?;
        qcow2::check_l1_table(&header, &l1, file.total)?;
        Ok(Map { header, l1 })
    }

    /// Guest bytes covered by one L1 entry.
    fn l1_span(&self) -> u64 {
        let cluster = self.header.cluster_size();
        cluster * (cluster / 8)
    }
}

/// Writes the virtual disk of the image in order into the new raw file
/// `dst`, hashing it on the way: ranges that `map` shows hold no data
/// become holes (hashed as zeros) without being read; standard clusters are
/// read straight into the output chunks (host-contiguous runs in one read),
/// compressed clusters decoded as qemu decodes them, on every core (see
/// `clusters`). Data read from the source is given back by `reclaim`.
fn child_copy(
    dst: &Path,
    served: Served,
    map: &Map,
    tables: &GrowingFile,
    reclaim: &mut Reclaimer,
) -> Result<Digests> {
    let sink = BlockingSink::create(dst, served)?;
    let mut out = Output::new(sink, tables, reclaim, &map.header);
    match queue_disk(map, tables, &mut out) {
        Ok(()) => out.finish(),
        Err(e) => Err(out.first_error(e)),
    }
}

/// Queues the whole virtual disk into `out`, table by table.
fn queue_disk(map: &Map, tables: &GrowingFile, out: &mut Output<'_>) -> Result<()> {
    let virtual_size = raw_size(map.header.virtual_size);
    let mut l2 = vec![0u8; map.header.cluster_size() as usize];
    for (i, entry) in map.l1.chunks_exact(8).enumerate() {
        let i = i as u64;
        if i.saturating_mul(map.l1_span()) >= virtual_size {
            break;
        }
        out.report_progress();
        let l2_at = qcow2::l2_offset(u64::from_be_bytes(entry.try_into().unwrap_or_default()));
        if l2_at == 0 {
            continue;
        }
        tables.read_waiting(l2_at, &mut l2)?;
        out.check_unclaimed(&qcow2::compressed_extents(&map.header, &l2))?;
        for run in qcow2::data_runs(&map.header, i, &l2, tables.total)? {
            let end = (run.guest + run.len).min(virtual_size);
            let start = run.guest.max(out.queued_to());
            if start >= end {
                continue;
            }
            out.zeros_to(start)?;
            match run.stored {
                qcow2::Stored::Plain(host) => out.plain(host + (start - run.guest), end)?,
                qcow2::Stored::Compressed { offset, len } => {
                    out.compressed(run.guest, (offset, len), end)?
                }
            }
        }
    }
    out.zeros_to(virtual_size)
}
