//! A test certificate authority made with openssl, for the servers and
//! clients of the TLS tests (image server, registry, HTTPS source, broker).

use super::tool;
use std::path::{Path, PathBuf};

/// A CA (`<name>.pem`, `<name>.key`) in a directory, which signs the
/// certificates the tests' servers and clients present.
pub struct TestCa {
    dir: PathBuf,
    /// The CA certificate, for whoever must trust what it signs.
    pub pem: PathBuf,
    key: PathBuf,
}

/// `openssl` arguments that make a P-256 key.
const EC_KEY: [&str; 4] = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"];

impl TestCa {
    /// Makes the CA `name` (also its subject's CN) in `dir`.
    pub fn new(dir: &Path, name: &str) -> TestCa {
        std::fs::create_dir_all(dir).unwrap();
        let (pem, key) = (
            dir.join(format!("{name}.pem")),
            dir.join(format!("{name}.key")),
        );
        let mut args = vec!["req", "-x509"];
        args.extend(EC_KEY);
        let subject = format!("/CN={name}");
        args.extend([
            "-nodes",
            "-days",
            "2",
            "-subj",
            &subject,
            "-keyout",
            key.to_str().unwrap(),
            "-out",
            pem.to_str().unwrap(),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ]);
        tool("openssl", &args);
        TestCa {
            dir: dir.to_path_buf(),
            pem,
            key,
        }
    }

    /// Signs a certificate `<leaf>.pem` for the subject CN `cn` with the
    /// X.509 extensions `ext` (one `name=value` a line: subjectAltName,
    /// extendedKeyUsage, ...), its key in `<leaf>.key`; returns both.
    pub fn issue(&self, leaf: &str, cn: &str, ext: &str) -> (PathBuf, PathBuf) {
        let file = |suffix: &str| self.dir.join(format!("{leaf}.{suffix}"));
        let (pem, key, csr, extfile) = (file("pem"), file("key"), file("csr"), file("ext"));
        std::fs::write(&extfile, ext).unwrap();
        let mut args = vec!["req"];
        args.extend(EC_KEY);
        let subject = format!("/CN={cn}");
        args.extend(["-nodes", "-subj", &subject]);
        args.extend([
            "-keyout",
            key.to_str().unwrap(),
            "-out",
            csr.to_str().unwrap(),
        ]);
        tool("openssl", &args);
        tool(
            "openssl",
            &[
                "x509",
                "-req",
                "-in",
                csr.to_str().unwrap(),
                "-CA",
                self.pem.to_str().unwrap(),
                "-CAkey",
                self.key.to_str().unwrap(),
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                extfile.to_str().unwrap(),
                "-out",
                pem.to_str().unwrap(),
            ],
        );
        (pem, key)
    }
}
