//! Test images and reference digests: files made with `qemu-img` and
//! seeded random bytes, and the digests and data ranges the checks compare
//! against, computed by reference tools.

use super::*;

/// Runs a reference tool and returns its stdout, panicking on failure.
pub fn tool(cmd: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(cmd).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The MD5 of a file (hex), by OpenSSL, a reference independent of the
/// worker's own hashing.
pub fn md5sum(path: &Path) -> String {
    openssl_digest("md5", path)
}

/// The SHA-256 of a file (hex), by OpenSSL.
pub fn sha256sum(path: &Path) -> String {
    openssl_digest("sha256", path)
}

/// The SHA-512 of a file (hex), by OpenSSL.
pub fn sha512sum(path: &Path) -> String {
    openssl_digest("sha512", path)
}

/// The `algo` digest of a file (hex), by `openssl dgst`: coreutils'
/// `sha256sum` takes six times its CPU here (no SHA instructions), and the
/// tests hash gigabytes of reference images. A file with holes is fed
/// through a pipe with its holes as zeros from memory: the first read of a
/// hole makes the kernel zero page cache for it, 20 s of system time for
/// the 8 GiB of a sparse test's reference.
pub fn openssl_digest(algo: &str, path: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom, Write};
    let len = std::fs::metadata(path).unwrap().len();
    let ranges = data_ranges(path);
    let dash_algo = format!("-{algo}");
    let out = if ranges.iter().map(|(a, b)| b - a).sum::<u64>() == len {
        tool(
            "openssl",
            &["dgst", &dash_algo, "-r", path.to_str().unwrap()],
        )
    } else {
        let mut child = std::process::Command::new("openssl")
            .args(["dgst", &dash_algo, "-r"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut pipe = child.stdin.take().unwrap();
        let mut file = std::fs::File::open(path).unwrap();
        let zeros = vec![0u8; 1 << 20];
        let mut buf = vec![0u8; 1 << 20];
        let mut at = 0;
        for (start, end) in ranges.into_iter().chain([(len, len)]) {
            while at < start {
                let n = (start - at).min(zeros.len() as u64) as usize;
                pipe.write_all(&zeros[..n]).unwrap();
                at += n as u64;
            }
            file.seek(SeekFrom::Start(at)).unwrap();
            while at < end {
                let n = (end - at).min(buf.len() as u64) as usize;
                file.read_exact(&mut buf[..n]).unwrap();
                pipe.write_all(&buf[..n]).unwrap();
                at += n as u64;
            }
        }
        drop(pipe);
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "openssl dgst {dash_algo} failed");
        String::from_utf8(out.stdout).unwrap()
    };
    out.split_whitespace().next().unwrap().to_string()
}

/// The `(start, end)` ranges of `path` that are not holes (SEEK_DATA /
/// SEEK_HOLE), in order.
pub fn data_ranges(path: &Path) -> Vec<(u64, u64)> {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path).unwrap();
    let len = file.metadata().unwrap().len() as i64;
    let mut ranges = Vec::new();
    let mut at = 0i64;
    while at < len {
        // SAFETY: lseek on a descriptor this function owns; no memory is passed.
        let data = unsafe { libc::lseek(file.as_raw_fd(), at, libc::SEEK_DATA) };
        if data < 0 {
            break; // ENXIO: only a hole from here to the end.
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(file.as_raw_fd(), data, libc::SEEK_HOLE) };
        assert!(hole > data, "SEEK_HOLE of {path:?} at {data}");
        ranges.push((data as u64, hole as u64));
        at = hole;
    }
    ranges
}

/// Writes `len` pseudo-random bytes (seeded, so failures reproduce).
pub fn random_file(path: &Path, len: usize, seed: u64) {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut data = Vec::with_capacity(len + 8);
    while data.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        data.extend_from_slice(&state.to_le_bytes());
    }
    data.truncate(len);
    std::fs::write(path, data).unwrap();
}

/// Writes a sparse raw disk of `size` bytes with random data at a few
/// places (start, a third, the middle, the end) and zeros elsewhere.
pub fn patchy_raw(path: &Path, size: u64, seed: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let chunk_path = dir.path().join("chunk");
    random_file(&chunk_path, 64 * 1024 + 17, seed);
    let chunk = std::fs::read(chunk_path).unwrap();
    for (i, at) in [0, size / 3, size / 2 + 4096, size.saturating_sub(70_000)]
        .iter()
        .enumerate()
    {
        let at = (*at).min(size.saturating_sub(chunk.len() as u64));
        f.write_all_at(&chunk[..chunk.len() - i], at).unwrap();
    }
}

/// `qemu-img convert -O raw` of the qcow2 `img` into `out`: the reference.
pub fn reference_raw(img: &Path, out: &Path) {
    tool(
        "qemu-img",
        &[
            "convert",
            "-f",
            "qcow2",
            "-O",
            "raw",
            img.to_str().unwrap(),
            out.to_str().unwrap(),
        ],
    );
}

/// Makes a qcow2 from a raw file with `qemu-img convert` (options in `opts`).
pub fn qcow2_from(raw: &Path, out: &Path, opts: &[&str]) {
    let mut args = vec!["convert", "-f", "raw", "-O", "qcow2"];
    args.extend_from_slice(opts);
    args.push(raw.to_str().unwrap());
    args.push(out.to_str().unwrap());
    tool("qemu-img", &args);
}

/// A qcow2 at `out` backed by the raw file `base` (named by the path given,
/// its size taken): created with `-u`, so qemu-img opens nothing.
pub fn qcow2_backed_by(base: &Path, out: &Path) {
    let size = std::fs::metadata(base).unwrap().len().to_string();
    let (base, out) = (base.to_str().unwrap(), out.to_str().unwrap());
    tool(
        "qemu-img",
        &[
            "create", "-f", "qcow2", "-u", "-b", base, "-F", "raw", out, &size,
        ],
    );
}
