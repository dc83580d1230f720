#!/usr/bin/env python3
"""Generate a corpus of qcow2 images with qemu-img/qemu-io and their
references (`qemu-img convert -O raw`), for the converter's differential
tests (tests/it/corpus.rs) and bench/corpus.

Usage: qcow2_corpus.py OUTDIR [--fast] [--count N] [--seed S]

  --fast     the fixed slice: every known hard case plus a few random ones
  --count N  random cases (default 0 with --fast, 300 without)

Writes OUTDIR/img/NAME.qcow2 (and whatever a case needs beside it: backing
or data files, always inside OUTDIR), OUTDIR/ref/NAME.raw for the images
qemu-img converts, and OUTDIR/manifest.json: a list of
  {"name", "image", "expect": "bytes" | "unsafe" | "corrupt",
   "ref", "md5", "size", "allocated", "why", "streamable"}
"bytes": our result must be qemu-img's, byte for byte. "unsafe": qemu-img
converts it but follows another file (backing, data file) or decrypts; it
must be refused as unsafe_image. "corrupt": qemu-img refuses it (or
`qemu-img check` reports it corrupt and the worker refuses it by policy);
it must be refused (corrupt_image or unsafe_image). "streamable": an http
source of it is converted while it downloads.
Nothing is written outside OUTDIR; only qemu-img and qemu-io make images
(some cases then edit one L2 entry or one compressed stream, as a corrupt
image would).
"""
import hashlib
import json
import os
import random
import struct
import subprocess
import sys
import zlib

KIB, MIB = 1024, 1024 * 1024
CLUSTERS = [512, 1024, 2048, 4096, 8192, 16384, 65536, 262144, MIB, 2 * MIB]


def run(*args, check=True):
    p = subprocess.run(args, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {p.stderr.strip()}")
    return p


def qemu_io(img, cmds, check=True):
    """Runs qemu-io commands on img; qemu-io tells failures on stdout."""
    args = ["qemu-io", "-f", "qcow2"]
    for c in cmds:
        args += ["-c", c]
    p = run(*args, img, check=check)
    failed = "failed" in p.stdout or "error" in p.stdout.lower()
    if check and failed:
        raise RuntimeError(f"qemu-io {cmds}: {p.stdout.strip()}")
    return not failed


def create(img, size, opts="", extra=()):
    args = ["qemu-img", "create", "-q", "-f", "qcow2"]
    if opts:
        args += ["-o", opts]
    run(*args, *extra, img, str(size))


def be64(b, at):
    return struct.unpack(">Q", b[at:at + 8])[0]


def l2_entries(img):
    """(offset of the entry in the file, entry) of the first L2 table."""
    b = open(img, "rb").read()
    cluster = 1 << struct.unpack(">I", b[20:24])[0]
    l2 = be64(b, be64(b, 40)) & 0x00FFFFFFFFFFFE00
    return [(l2 + 8 * j, be64(b, l2 + 8 * j)) for j in range(cluster // 8)]


def set_entry(img, at, value):
    with open(img, "r+b") as f:
        f.seek(at)
        f.write(struct.pack(">Q", value))


# ---- the fixed cases: every known hard case, minimal -------------------


def fixed_cases():
    """(name, build(img, dir), why): build makes the image at img."""
    cases = []

    def case(name, why):
        def wrap(build):
            cases.append((name, build, why))
            return build
        return wrap

    @case("zlib-512-partial", "zlib clusters at 512 B served as zeros")
    def _(img, d):
        create(img, 3627520, "compat=1.1,cluster_size=512")
        qemu_io(img, ["write -q -c -P 0x3a 3059200 1536", "write -q -P 0x94 2546176 1024",
                      "flush", "write -q -c 0 0"])

    @case("zlib-1k", "zlib clusters at 1 KiB served as zeros")
    def _(img, d):
        create(img, 1 * MIB, "cluster_size=1024")
        qemu_io(img, ["write -q -c -P 0x5c 0 8k", "write -q -c -P 0x17 512k 3k"])

    @case("zlib-512-hang", "100% CPU hang at 512 B zlib clusters")
    def _(img, d):
        create(img, 64 * KIB, "cluster_size=512,compression_type=zlib")
        qemu_io(img, ["write -q -c -P 0x41 0 4096", "write -q -c 0 0"])

    @case("zlib-2k-hang", "hang at 2 KiB zlib clusters")
    def _(img, d):
        create(img, 64 * KIB, "cluster_size=2048")
        qemu_io(img, ["write -q -c -P 0x41 0 8192", "write -q -c 0 0"])

    @case("zstd-512", "zstd at 512 B clusters")
    def _(img, d):
        create(img, 64 * KIB, "cluster_size=512,compression_type=zstd")
        qemu_io(img, ["write -q -c -P 0x41 0 4096", "write -q -P 0x42 8k 1k"])

    @case("snapshot-last", "internal snapshot taken last: padding past EOF")
    def _(img, d):
        create(img, 1 * MIB)
        qemu_io(img, ["write -q -P 0x41 0 4096"])
        run("qemu-img", "snapshot", "-c", "s1", img)

    @case("snapshot-applied-deleted", "snapshots created, applied, deleted")
    def _(img, d):
        create(img, 2 * MIB, "cluster_size=4096")
        qemu_io(img, ["write -q -P 0x41 0 64k"])
        run("qemu-img", "snapshot", "-c", "s1", img)
        qemu_io(img, ["write -q -P 0x42 32k 64k"])
        run("qemu-img", "snapshot", "-c", "s2", img)
        run("qemu-img", "snapshot", "-a", "s1", img, check=False)
        run("qemu-img", "snapshot", "-d", "s2", img)
        qemu_io(img, ["write -q -c -P 0x43 1M 8k"])

    @case("compressed-past-eof", "compressed data ends past EOF")
    def _(img, d):
        create(img, 1 * MIB, "cluster_size=4096")
        qemu_io(img, ["write -q -c -P 0x71 0 8192"])

    @case("virtual-size-0", "virtual size 0 panicked")
    def _(img, d):
        create(img, 0, "cluster_size=4096")

    @case("virtual-size-0-v2", "virtual size 0, v2, 512 B clusters")
    def _(img, d):
        create(img, 0, "compat=0.10,cluster_size=512")

    @case("odd-size", "virtual size not a multiple of the cluster")
    def _(img, d):
        create(img, 13 * MIB + 3 * 512, "cluster_size=65536")
        qemu_io(img, ["write -q -P 0x11 0 100k", "write -q -P 0x22 13M 1536",
                      "write -q -c -P 0x33 12M 64k"])

    @case("zero-discard-v3", "zero and discarded clusters over data")
    def _(img, d):
        create(img, 8 * MIB, "cluster_size=65536")
        qemu_io(img, ["write -q -P 0x5a 0 4M", "write -q -z 1M 512k", "write -q -z -u 2M 1M",
                      "discard -q 3M 256k", "write -q -c -P 0x6b 6M 128k", "write -q -z 6M 64k"])

    @case("discard-v2", "discarded clusters in a v2 image")
    def _(img, d):
        create(img, 4 * MIB, "compat=0.10,cluster_size=4096")
        qemu_io(img, ["write -q -P 0x5a 0 1M", "discard -q 256k 256k", "write -q -z 768k 4k"])

    @case("extended-l2", "extended L2 entries (subclusters)")
    def _(img, d):
        create(img, 4 * MIB, "extended_l2=on,cluster_size=65536")
        qemu_io(img, ["write -q -P 0x5a 0 5k", "write -q -P 0x6b 1M 70k", "write -q -z 1M 2k",
                      "write -q -c -P 0x7c 2M 64k"])

    @case("resized", "grown and shrunk")
    def _(img, d):
        create(img, 3 * MIB, "cluster_size=16384")
        qemu_io(img, ["write -q -P 0x5a 0 3M"])
        run("qemu-img", "resize", "-q", img, "7M")
        qemu_io(img, ["write -q -P 0x6b 6M 64k"])
        run("qemu-img", "resize", "-q", "--shrink", img, str(5 * MIB + 512))

    @case("amended-v3-to-v2", "amended compat=0.10 (zero clusters expanded)")
    def _(img, d):
        create(img, 2 * MIB, "compat=1.1,cluster_size=4096")
        qemu_io(img, ["write -q -P 0x5a 0 1M", "write -q -z 64k 64k"])
        run("qemu-img", "amend", "-o", "compat=0.10", img)

    @case("amended-refcount", "amended refcount_bits")
    def _(img, d):
        create(img, 2 * MIB, "refcount_bits=64")
        qemu_io(img, ["write -q -P 0x5a 0 1M"])
        run("qemu-img", "amend", "-o", "refcount_bits=8", img)

    @case("committed", "overlay committed into its base")
    def _(img, d):
        create(img, 2 * MIB)
        qemu_io(img, ["write -q -P 0x5a 0 1M"])
        top = os.path.join(d, "committed-top.qcow2")
        create(top, 2 * MIB, extra=["-b", img, "-F", "qcow2"])
        qemu_io(top, ["write -q -P 0x6b 512k 1M"])
        run("qemu-img", "commit", "-q", top)

    @case("rebased-standalone", "rebase -u onto nothing: standalone")
    def _(img, d):
        create(img, 2 * MIB, "cluster_size=4096")
        qemu_io(img, ["write -q -P 0x5a 4k 8k"])
        base = os.path.join(d, "rebase-base.raw")
        open(base, "wb").truncate(2 * MIB)
        run("qemu-img", "rebase", "-u", "-b", base, "-F", "raw", img)
        run("qemu-img", "rebase", "-u", "-b", "", img)

    @case("convert-c-zstd", "convert -c, zstd")
    def _(img, d):
        src = os.path.join(d, "czstd-src.qcow2")
        create(src, 4 * MIB)
        qemu_io(src, ["write -q -P 0x5a 0 1M", "write -q -P 0x00 2M 64k"])
        run("qemu-img", "convert", "-q", "-c", "-O", "qcow2", "-o",
            "compression_type=zstd,cluster_size=2097152", src, img)

    @case("convert-c-zlib-2m", "convert -c, zlib, 2 MiB clusters")
    def _(img, d):
        src = os.path.join(d, "czlib-src.qcow2")
        create(src, 5 * MIB)
        qemu_io(src, ["write -q -P 0x5a 0 1M", "write -q -P 0x3c 4M 100k"])
        run("qemu-img", "convert", "-q", "-c", "-O", "qcow2", "-o", "cluster_size=2097152",
            src, img)

    # Unsafe: qemu-img converts them, following another file.
    @case("backing", "backing file")
    def _(img, d):
        base = os.path.join(d, "backing-base.qcow2")
        create(base, MIB)
        qemu_io(base, ["write -q -P 0x5a 0 4k"])
        create(img, MIB, extra=["-b", base, "-F", "qcow2"])

    @case("rebased-onto-base", "rebase -u onto a base: backing file")
    def _(img, d):
        base = os.path.join(d, "rebase2-base.raw")
        open(base, "wb").truncate(MIB)
        create(img, MIB)
        run("qemu-img", "rebase", "-u", "-b", base, "-F", "raw", img)

    @case("data-file", "external data file")
    def _(img, d):
        create(img, MIB, f"data_file={os.path.join(d, 'data-file.bin')}")
        qemu_io(img, ["write -q -P 0x5a 0 4k"])

    @case("luks", "LUKS-encrypted (slow to make: not in --fast)")
    def _(img, d):
        create(img, MIB, "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10",
               extra=["--object", "secret,id=sec0,data=hunter2"])

    # Corrupt: one edited entry or stream.
    @case("short-inflate", "a compressed cluster inflating to 100 bytes")
    def _(img, d):
        create(img, MIB, "cluster_size=4096")
        qemu_io(img, ["write -q -c -P 0x5a 0 4k", "write -q -P 0x11 16k 4k"])
        entry = l2_entries(img)[0][1]
        offset = entry & ((1 << (62 - (12 - 8))) - 1)
        stream = zlib.compressobj(6, zlib.DEFLATED, -12)
        data = stream.compress(bytes(range(100))) + stream.flush()
        # The stream is replaced; its L2 entry (and sector count) stays.
        with open(img, "r+b") as f:
            f.seek(offset)
            f.write(data)

    @case("v2-zero-flag", "the v3-only zero flag in a v2 image")
    def _(img, d):
        create(img, MIB, "compat=0.10,cluster_size=65536")
        qemu_io(img, ["write -q -P 0x41 0 128k"])
        at, entry = l2_entries(img)[1]
        set_entry(img, at, entry | 1)

    @case("shared-clusters", "two guest clusters on the same host cluster")
    def _(img, d):
        create(img, MIB, "cluster_size=4096")
        qemu_io(img, ["write -q -P 0x41 0 8k", "write -q -P 0x42 36k 4k"])
        entries = l2_entries(img)
        set_entry(img, entries[9][0], entries[1][1])

    return cases


# ---- random cases -------------------------------------------------------


def random_case(rng, i):
    """A random image recipe: (name, build, why)."""
    v3 = rng.random() < 0.75
    cluster = rng.choice(CLUSTERS)
    opts = [f"compat={'1.1' if v3 else '0.10'}", f"cluster_size={cluster}"]
    if v3 and cluster >= 16384 and rng.random() < 0.2:
        opts.append("extended_l2=on")
    if v3 and rng.random() < 0.3:
        opts.append("compression_type=" + rng.choice(["zlib", "zstd"]))
    if v3 and rng.random() < 0.15:
        opts.append(f"refcount_bits={rng.choice([1, 2, 8, 32, 64])}")
    size = rng.choice([0, 512, rng.randrange(1, 64) * 512, rng.randrange(1, 8 * MIB // 512) * 512,
                       rng.randrange(1, 64) * MIB, rng.randrange(1, 64) * MIB + 512 * rng.randrange(1, 100)])
    ops = []
    for _ in range(rng.randrange(0, 8)):
        if size == 0:
            break
        kind = rng.choice(["write", "write", "compressed", "compressed", "zero", "discard",
                           "snapshot", "resize", "amend", "convert"])
        ops.append((kind, rng.random(), rng.random(), rng.randrange(1, 255)))
    why = ",".join(opts) + f" size={size} ops=" + ",".join(o[0] for o in ops)

    def build(img, d):
        create(img, size, ",".join(opts))
        state = {"size": size, "cluster": cluster, "snaps": 0}
        for kind, a, b, pattern in ops:
            apply_op(img, d, state, kind, a, b, pattern, opts)

    return (f"r{i:04d}", build, why)


def apply_op(img, d, state, kind, a, b, pattern, opts):
    size, cluster = state["size"], state["cluster"]
    if size == 0:
        return
    unit = 512
    off = int(a * size) // unit * unit
    length = max(unit, int(b * min(size - off, 4 * MIB)) // unit * unit)
    length = min(length, size - off) if off < size else 0
    if length <= 0:
        return
    if kind == "write":
        qemu_io(img, [f"write -q -P {pattern} {off} {length}"], check=False)
    elif kind == "compressed":
        off = off // cluster * cluster
        length = max(cluster, length // cluster * cluster)
        if off + length > size:
            length = size - off  # the last, partial cluster
        if length > 0:
            qemu_io(img, [f"write -q -c -P {pattern} {off} {length}"], check=False)
    elif kind == "zero":
        flag = "-u " if pattern % 2 else ""
        qemu_io(img, [f"write -q -z {flag}{off} {length}"], check=False)
    elif kind == "discard":
        qemu_io(img, [f"discard -q {off} {length}"], check=False)
    elif kind == "snapshot":
        state["snaps"] += 1
        name = f"s{state['snaps']}"
        run("qemu-img", "snapshot", "-c", name, img, check=False)
        if pattern % 3 == 0 and state["snaps"] > 1:
            run("qemu-img", "snapshot", "-a", "s1", img, check=False)
        if pattern % 4 == 0:
            run("qemu-img", "snapshot", "-d", name, img, check=False)
    elif kind == "resize":
        new = max(512, int(size * (0.5 + a)) // 512 * 512)
        shrink = ["--shrink"] if new < size else []
        if run("qemu-img", "resize", "-q", *shrink, img, str(new), check=False).returncode == 0:
            state["size"] = new
    elif kind == "amend":
        if "extended_l2=on" in opts or "compression_type=zstd" in opts:
            return
        target = "compat=0.10" if pattern % 2 else "compat=1.1"
        run("qemu-img", "amend", "-q", "-o", target, img, check=False)
    elif kind == "convert":
        tmp = img + ".conv"
        copts = [o for o in opts if not o.startswith("refcount")]
        args = ["qemu-img", "convert", "-q", "-O", "qcow2", "-o", ",".join(copts)]
        if pattern % 2:
            args.insert(2, "-c")
        if run(*args, img, tmp, check=False).returncode == 0:
            os.replace(tmp, img)


# ---- references ----------------------------------------------------------

UNSAFE = ("backing", "rebased-onto-base", "data-file", "luks")
# qemu-img reads these, but `qemu-img check` reports them corrupt, and the
# worker refuses them (a converter giving back what it read cannot read a
# host cluster twice): refused on every path.
REFUSED_AS_CORRUPT = ("shared-clusters",)


def streamable(img):
    """Whether the worker converts this image while it downloads: no
    internal snapshots, standard L2 entries."""
    b = open(img, "rb").read(104)
    version = struct.unpack(">I", b[4:8])[0]
    snapshots = struct.unpack(">I", b[60:64])[0]
    incompat = struct.unpack(">Q", b[72:80])[0] if version >= 3 else 0
    return snapshots == 0 and not incompat & (1 << 4)


def reference(name, img, refdir):
    ref = os.path.join(refdir, name + ".raw")
    source = ["-f", "qcow2", img]
    if name == "luks":
        source = ["--object", "secret,id=sec0,data=hunter2", "--image-opts",
                  f"driver=qcow2,file.filename={img},encrypt.key-secret=sec0"]
    p = run("qemu-img", "convert", "-q", *source, "-O", "raw", ref, check=False)
    if p.returncode != 0:
        return {"expect": "corrupt", "qemu_error": p.stderr.strip()}
    h = hashlib.md5()
    with open(ref, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    out = {"expect": "bytes", "ref": ref, "md5": h.hexdigest(), "size": os.path.getsize(ref),
           "allocated": os.stat(ref).st_blocks * 512}
    if name in UNSAFE:
        out["expect"] = "unsafe"
    if name in REFUSED_AS_CORRUPT:
        out["expect"] = "corrupt"
    return out


def main():
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    out = args[0]
    fast = "--fast" in args
    count = int(args[args.index("--count") + 1]) if "--count" in args else (0 if fast else 300)
    seed = int(args[args.index("--seed") + 1]) if "--seed" in args else 24
    imgdir, refdir = os.path.join(out, "img"), os.path.join(out, "ref")
    os.makedirs(imgdir, exist_ok=True)
    os.makedirs(refdir, exist_ok=True)
    rng = random.Random(seed)
    fixed = [c for c in fixed_cases() if not (fast and "not in --fast" in c[2])]
    cases = fixed + [random_case(rng, i) for i in range(count)]
    manifest = []
    for name, build, why in cases:
        img = os.path.join(imgdir, name + ".qcow2")
        try:
            build(img, imgdir)
        except RuntimeError as e:
            print(f"{name}: not generated: {e}", file=sys.stderr)
            continue
        entry = {"name": name, "image": img, "why": why, "streamable": streamable(img)}
        entry.update(reference(name, img, refdir))
        manifest.append(entry)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"{len(manifest)} images in {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
