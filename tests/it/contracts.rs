//! Contracts other programs rely on: configuration precedence and the
//! closed list of error codes in the completion schema.

use ironic_image_worker::config::{Config, Files, ImageDownloadSource, SslVersion};
use ironic_image_worker::error::ErrorCode;
use ironic_image_worker::image_format::Format;

#[test]
fn schema_lists_exactly_the_error_codes() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/schemas/completion.v1.json"
    ))
    .unwrap();
    let schema: serde_json::Value = serde_json::from_str(&text).unwrap();
    let listed: Vec<String> = schema["properties"]["error"]["properties"]["code"]["enum"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    let ours: Vec<String> = ErrorCode::ALL
        .iter()
        .map(|c| c.as_str().to_string())
        .collect();
    assert_eq!(listed, ours);
    for code in ErrorCode::ALL {
        assert_eq!(serde_json::to_value(code).unwrap(), code.as_str());
    }
}

#[test]
fn file_then_environment_then_flags() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("w.toml");
    std::fs::write(
        &file,
        "[DEFAULT]\nhost = \"from-file\"\nforce_raw_images = false\n[pxe]\nimage_cache_size = 100\n[conductor]\npermitted_image_formats = \"raw, qcow2\"\n",
    )
    .unwrap();
    let env = vec![
        (
            "IRONIC_IMAGE_WORKER__DEFAULT__HOST".to_string(),
            "from-env".to_string(),
        ),
        (
            "IRONIC_IMAGE_WORKER__PXE__IMAGE_CACHE_SIZE".to_string(),
            "200".to_string(),
        ),
        (
            "IRONIC_IMAGE_WORKER__HTTP__LISTEN".to_string(),
            "127.0.0.1:9999".to_string(),
        ),
    ];
    let c = Config::load_from(&toml_file(&file), &env, &["DEFAULT.host=from-flag".into()]).unwrap();
    assert_eq!(c.default.host, "from-flag");
    assert!(!c.default.force_raw_images);
    assert_eq!(c.pxe.image_cache_size, 200);
    assert_eq!(c.http.listen.port(), 9999);
    assert_eq!(
        c.conductor.permitted_image_formats,
        [Format::Raw, Format::Qcow2]
    );
    assert_eq!(c.http_url(), "http://127.0.0.1:9999");

    assert!(
        Config::load_from(
            &Files::default(),
            &[],
            &["agent.image_download_source=ftp".into()]
        )
        .is_err()
    );
    assert!(Config::load_from(&Files::default(), &[], &["nosuch.option=1".into()]).is_err());
}

#[test]
fn defaults_need_no_root() {
    let c = Config::load_from(&Files::default(), &[], &[]).unwrap();
    assert!(
        c.pxe.instance_master_path.is_relative()
            || !c.pxe.instance_master_path.starts_with("/var/lib")
    );
    assert_eq!(c.amqp.url, ["amqp://guest:guest@127.0.0.1:5672/%2f"]);
    assert_eq!(c.deploy.http_image_subdir, "agent_images");
    assert_eq!(
        c.conductor.permitted_image_formats,
        [Format::Raw, Format::Gpt, Format::Qcow2, Format::Iso]
    );
    assert!(c.default.force_raw_images && c.agent.stream_raw_images);
    assert_eq!(c.amqp.url_redacted(), "amqp://guest:***@127.0.0.1:5672/%2f");
}

fn toml_file(path: &std::path::Path) -> Files {
    Files {
        toml: Some(path.to_path_buf()),
        ..Files::default()
    }
}

#[test]
fn ironic_conf_gives_the_shared_options_and_our_file_overrides_it() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let dir = tempfile::tempdir().unwrap();
    let own = dir.path().join("w.toml");
    std::fs::write(
        &own,
        "[http]\nlisten = \"192.0.2.10:8088\"\n[pxe]\nimage_cache_ttl = 60\n",
    )
    .unwrap();
    let files = Files {
        ironic_conf: Some(fixtures.join("ironic.conf")),
        toml: Some(own),
    };
    let c = Config::load_from(&files, &[], &["DEFAULT.force_raw_images=false".into()]).unwrap();
    assert_eq!(c.default.host, "cond-7.example.net");
    assert!(!c.default.force_raw_images, "--set beats ironic.conf");
    assert_eq!(
        c.amqp.url,
        [
            "amqp://ironic:Sup3r%2Fsecret@mq-1.example.net:5672/ironic",
            "amqp://ironic:Sup3r%2Fsecret@mq-2.example.net:5672/ironic"
        ],
        "every transport_url host"
    );
    assert_eq!(c.amqp.notification_exchange, "ironic");
    assert_eq!(
        c.amqp.notification_topics,
        ["ironic_versioned_notifications", "ops_notifications"]
    );
    assert!(c.amqp.notification_exchange_durable);
    assert_eq!(c.agent.image_download_source, ImageDownloadSource::Http);
    assert_eq!(c.deploy.http_root, std::path::Path::new("/srv/httpboot"));
    assert_eq!(c.http_url(), "http://192.0.2.10:8088");
    assert_eq!(
        c.pxe.images_path,
        std::path::Path::new("/var/lib/ironic/images")
    );
    assert_eq!(
        c.pxe.instance_master_path,
        std::path::Path::new("/var/lib/ironic-image-worker/master_images"),
        "never Ironic's master directory"
    );
    assert_eq!(c.pxe.image_cache_size, 51200);
    assert_eq!(c.pxe.image_cache_ttl, 60, "our file beats ironic.conf");
    assert_eq!(
        c.conductor.permitted_image_formats,
        [Format::Raw, Format::Qcow2]
    );
    assert_eq!(
        c.conductor.file_url_allowed_paths,
        [
            std::path::PathBuf::from("/var/lib/ironic"),
            "/srv/images".into()
        ]
    );
    assert_eq!(c.glance.password, "gl@nce pass");
    assert_eq!(c.glance.valid_interfaces, ["internal"]);
    assert_eq!(c.glance.auth_url, "http://keystone.example.net:5000/v3");

    // Unset in ironic.conf: Ironic's defaults, and the worker's own
    // image_download_source (only an explicit setting counts).
    std::fs::write(dir.path().join("min.conf"), "[DEFAULT]\nhost = c\n").unwrap();
    let c = Config::load_from(
        &Files {
            ironic_conf: Some(dir.path().join("min.conf")),
            toml: None,
        },
        &[],
        &[],
    )
    .unwrap();
    assert_eq!(c.deploy.http_root, std::path::Path::new("/httpboot"));
    assert_eq!(c.agent.image_download_source, ImageDownloadSource::Local);
    assert_eq!(c.amqp.url, ["amqp://guest:guest@127.0.0.1:5672/%2f"]);
}

#[test]
fn ironic_master_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir_all(state.join("master_images")).unwrap();
    let conf = dir.path().join("ironic.conf");
    std::fs::write(
        &conf,
        format!("[DEFAULT]\nhost = c\nstate_path = {}\n", state.display()),
    )
    .unwrap();
    let files = |toml: Option<std::path::PathBuf>| Files {
        ironic_conf: Some(conf.clone()),
        toml,
    };
    let own = |master: &str| {
        let p = dir.path().join("w.toml");
        std::fs::write(&p, format!("[pxe]\ninstance_master_path = \"{master}\"\n")).unwrap();
        Some(p)
    };
    // Ironic's default, $state_path/master_images, written another way.
    let same = format!("{}/./master_images/", state.display());
    let err = Config::load_from(&files(own(&same)), &[], &[]).unwrap_err();
    assert!(
        err.message.contains("Ironic's master image directory"),
        "{err}"
    );
    // Through a symlink too (canonical paths).
    std::os::unix::fs::symlink(&state, dir.path().join("alias")).unwrap();
    let alias = format!("{}/alias/master_images", dir.path().display());
    assert!(Config::load_from(&files(own(&alias)), &[], &[]).is_err());
    // ironic.conf's explicit setting.
    std::fs::write(
        &conf,
        format!(
            "[DEFAULT]\nhost = c\n[pxe]\ninstance_master_path = {}/m\n",
            dir.path().display()
        ),
    )
    .unwrap();
    let explicit = format!("{}/m", dir.path().display());
    assert!(Config::load_from(&files(own(&explicit)), &[], &[]).is_err());
    // A directory of its own is fine, and never taken from ironic.conf.
    let c = Config::load_from(
        &files(own(&same.replace("master_images", "worker"))),
        &[],
        &[],
    )
    .unwrap();
    assert!(c.pxe.instance_master_path.ends_with("worker"));
    let c = Config::load_from(&files(None), &[], &[]).unwrap();
    assert_eq!(
        c.pxe.instance_master_path,
        std::path::Path::new("/var/lib/ironic-image-worker/master_images")
    );
}

#[test]
fn example_configuration_is_valid_and_shows_the_defaults() {
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("ops/worker.example.toml");
    let c = Config::load_from(&toml_file(&example), &[], &[]).unwrap();
    let d = Config::load_from(&Files::default(), &[], &[]).unwrap();
    assert_eq!(format!("{:?}", c.amqp), format!("{:?}", d.amqp));
    assert_eq!(format!("{:?}", c.convert), format!("{:?}", d.convert));
    assert_eq!(format!("{:?}", c.glance), format!("{:?}", d.glance));
    assert_eq!(
        c.conductor.permitted_image_formats,
        d.conductor.permitted_image_formats
    );
    assert_eq!(c.pxe.image_cache_size, d.pxe.image_cache_size);
}

/// Every option the worker reads, as `section.option`. Asked from the
/// configuration type itself: it refuses unknown names and lists the known
/// ones in its error, so a new option can never be left out here.
fn every_option() -> std::collections::BTreeSet<String> {
    let known = |toml_text: &str| -> Vec<String> {
        let err = toml::from_str::<Config>(toml_text)
            .expect_err("an unknown name is refused")
            .to_string();
        let listed = err
            .split_once("expected one of ")
            .or_else(|| err.split_once("expected "))
            .unwrap_or_else(|| panic!("no list of names in: {err}"))
            .1;
        listed
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect()
    };
    let mut all = std::collections::BTreeSet::new();
    for section in known("[no_such_section_]\n") {
        for option in known(&format!("[{section}]\nno_such_option_ = 1\n")) {
            all.insert(format!("{section}.{option}"));
        }
    }
    all
}

/// The options `ops/worker.example.toml` shows, set or commented out
/// (`# option = value` documents one whose default is computed).
fn example_options(text: &str) -> std::collections::BTreeSet<String> {
    let mut section = String::new();
    let mut shown = std::collections::BTreeSet::new();
    for line in text.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.to_string();
        } else if let Some((key, _)) = line.trim_start_matches(['#', ' ']).split_once('=') {
            let key = key.trim();
            if !key.is_empty()
                && key
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            {
                shown.insert(format!("{section}.{key}"));
            }
        }
    }
    shown
}

#[test]
fn example_configuration_shows_every_option() {
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("ops/worker.example.toml");
    let shown = example_options(&std::fs::read_to_string(example).unwrap());
    let all = every_option();
    assert!(all.len() > 50, "options found: {all:?}");
    let missing: Vec<_> = all.difference(&shown).collect();
    let unknown: Vec<_> = shown.difference(&all).collect();
    assert!(
        missing.is_empty(),
        "options missing from ops/worker.example.toml: {missing:?}"
    );
    assert!(
        unknown.is_empty(),
        "ops/worker.example.toml shows unknown options: {unknown:?}"
    );
}

/// Options that are strings stay strings when they come from the
/// environment or `--set`, whatever they look like.
#[test]
fn string_options_from_the_environment_stay_strings() {
    let env = vec![
        (
            "IRONIC_IMAGE_WORKER__GLANCE__PASSWORD".to_string(),
            "123456".to_string(),
        ),
        (
            "IRONIC_IMAGE_WORKER__DEFAULT__HOST".to_string(),
            "true".to_string(),
        ),
    ];
    let c = Config::load_from(
        &Files::default(),
        &env,
        &["glance.token=1e3".into(), "pxe.image_cache_size=7".into()],
    )
    .unwrap();
    assert_eq!(c.glance.password, "123456");
    assert_eq!(c.default.host, "true");
    assert_eq!(c.glance.token, "1e3");
    assert_eq!(c.pxe.image_cache_size, 7);
    // A number option still refuses what is not a number.
    assert!(
        Config::load_from(
            &Files::default(),
            &[],
            &["pxe.image_cache_size=lots".into()]
        )
        .is_err()
    );
}

/// Limits must be limits: zero prefetch (unlimited to the broker), unit
/// conversions that would overflow and out-of-range delivery limits are
/// refused at start, not wrapped.
#[test]
fn limits_that_are_not_limits_are_refused() {
    let refused = [
        "amqp.prefetch=0",
        "convert.max_virtual_size_gib=17179869184",
        "convert.memory_limit_mib=9223372036854775807",
        "pxe.image_cache_size=9223372036854775807",
        "pxe.image_cache_ttl=9223372036854775807",
        "amqp.delivery_limit=3000000000",
        "convert.raw_image_growth_factor=-1.0",
    ];
    for item in refused {
        let err = Config::load_from(&Files::default(), &[], &[item.into()]);
        assert!(err.is_err(), "{item} must be refused");
    }
    let c = Config::load_from(
        &Files::default(),
        &[],
        &["convert.max_virtual_size_gib=8192".into()],
    )
    .unwrap();
    assert_eq!(c.convert.qcow2_limits().max_virtual_size, 8192u64 << 30);
}

/// The default virtual-size limit is 1 TiB: Glance's default
/// `image_size_cap`, and about 22 minutes of one core for the MD5 of a
/// sparse disk that size (a 200 KB qcow2 may announce it), where 4 TiB
/// allowed a 1.5-hour hash per request.
#[test]
fn default_virtual_size_limit_is_one_tib() {
    let c = Config::load_from(&Files::default(), &[], &[]).unwrap();
    assert_eq!(c.convert.qcow2_limits().max_virtual_size, 1u64 << 40);
}

/// Credentials in URLs are masked whole: user and password, or a token
/// standing as the user name.
#[test]
fn urls_are_redacted_of_their_user_info() {
    use ironic_image_worker::secrets::redact_url;
    assert_eq!(
        redact_url("http://user:pw@host:8080/a@b?c=d@e"),
        "http://***@host:8080/a@b?c=***"
    );
    assert_eq!(redact_url("https://TOKEN@host/x"), "https://***@host/x");
    assert_eq!(redact_url("http://host/x"), "http://host/x");
    assert_eq!(redact_url("not a url at all"), "not a url at all");
    assert_eq!(redact_url("http://us er:p w@h/"), "http://***@h/");
}

/// A `[peers]url` or an `[amqp]url` that is refused is named with its
/// credentials masked.
#[test]
fn a_refused_peers_url_shows_no_credentials() {
    let err = Config::load_from(
        &Files::default(),
        &[],
        &[
            "peers.listen=127.0.0.1:0".to_string(),
            "peers.secret=0123456789abcdef0123456789abcdef".to_string(),
            "peers.url=http://peer:s3cret@10.0.0.1:8089/x?jwt=t0ken".to_string(),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("[peers]url"), "{err}");
    assert!(!err.contains("s3cret") && !err.contains("t0ken"), "{err}");
    // A raw `,` in a broker password: no part of it shown either.
    let err = Config::load_from(
        &Files::default(),
        &[],
        &["amqp.url=amqp://u:pa,ss@h1:5672/vh".to_string()],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("[amqp]url"), "{err}");
    assert!(!err.contains("pa,") && !err.contains(":pa"), "{err}");
}

/// `[amqp]url`: a TOML array, a comma-separated list of URLs, or
/// oslo.messaging's multi-host form; a malformed list is refused with the
/// password masked, never read as one URL.
#[test]
fn broker_url_lists() {
    let load =
        |value: &str| Config::load_from(&Files::default(), &[], &[format!("amqp.url={value}")]);
    let two = [
        "amqp://u:p1@h1:5672/%2f".to_string(),
        "amqp://v:p2@h2:5673/%2f".to_string(),
    ];
    assert_eq!(
        load(r#"["amqp://u:p1@h1:5672/%2f", "amqp://v:p2@h2:5673/%2f"]"#)
            .unwrap()
            .amqp
            .url,
        two
    );
    assert_eq!(
        load("amqp://u:p1@h1:5672/%2f,amqp://v:p2@h2:5673/%2f")
            .unwrap()
            .amqp
            .url,
        two
    );
    assert_eq!(
        load("amqp://u:p1@h1:5672,v:p2@h2:5673/%2f")
            .unwrap()
            .amqp
            .url,
        two
    );
    for bad in [
        "amqp://u:s3cret@h1:5672,,v:s3cret@h2/%2f",
        "http://u:s3cret@h1/",
        "amqp://u:s3cret@h1:notaport/%2f",
        "amqp://u:s3cret@h1/x,v:s3cret@h2",
        "amqp://u:s3,cret@h1:5672/vh",
    ] {
        let err = load(bad).unwrap_err().to_string();
        assert!(!err.contains("s3cret"), "password masked: {err}");
        assert!(err.contains("[amqp]url") || err.contains("amqp"), "{err}");
    }
    let tls = |extra: &str| {
        Config::load_from(
            &Files::default(),
            &[],
            &extra.split(';').map(String::from).collect::<Vec<_>>(),
        )
    };
    assert!(
        tls("amqp.ssl_cert_file=/etc/hostname").is_err(),
        "cert without key"
    );
    assert!(tls("amqp.ssl_ca_file=/nonexistent/ca.pem").is_err());
    assert!(tls("amqp.ssl_version=TLSv1_1").is_err());
    assert!(tls("amqp.ssl_version=TLSv1_2").is_ok());
    let d = tls("amqp.heartbeat=10").unwrap();
    assert_eq!(d.amqp.heartbeat, 10);
    assert!(d.amqp.ssl_verify_hostname);
}

/// ironic.conf: every transport_url host with its own credentials, and the
/// TLS files of [oslo_messaging_rabbit].
#[test]
fn ironic_conf_multi_host_transport_and_tls() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, "not read at load time").unwrap();
    let conf = dir.path().join("ironic.conf");
    std::fs::write(
        &conf,
        format!(
            "[DEFAULT]\nhost = c\ntransport_url = rabbit://a:pa@mq1:5671,b:pb@mq2:5672,c:pc@mq3/ironic\n\
             [oslo_messaging_rabbit]\nssl = true\nssl_ca_file = {}\nssl_version = TLSv1_2\n",
            ca.display()
        ),
    )
    .unwrap();
    let c = Config::load_from(
        &Files {
            ironic_conf: Some(conf),
            toml: None,
        },
        &[],
        &[],
    )
    .unwrap();
    assert_eq!(
        c.amqp.url,
        [
            "amqps://a:pa@mq1:5671/ironic",
            "amqps://b:pb@mq2:5672/ironic",
            "amqps://c:pc@mq3/ironic"
        ]
    );
    assert_eq!(c.amqp.ssl_ca_file, ca.display().to_string());
    assert_eq!(c.amqp.ssl_version, SslVersion::Tls12);
    assert_eq!(
        c.amqp.url_redacted(),
        "amqps://a:***@mq1:5671/ironic,amqps://b:***@mq2:5672/ironic,amqps://c:***@mq3/ironic"
    );
}

fn example_text() -> String {
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("ops/worker.example.toml");
    std::fs::read_to_string(example).unwrap()
}

/// The shipped sample sets nothing (as oslo's samples): installed as the
/// worker's file next to an ironic.conf, it overrides none of it.
#[test]
fn example_configuration_sets_nothing() {
    let text = example_text();
    let set: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with('['))
        .collect();
    assert!(set.is_empty(), "lines that set an option: {set:?}");
}

/// Each option's commented line shows its default, except those a
/// `Default:` comment marks as computed or unset (shown by example):
/// uncommented, the sample is the defaults.
#[test]
fn example_configuration_comments_are_the_defaults() {
    let mut uncommented = String::new();
    let mut example = false;
    let mut shown = 0;
    for line in example_text().lines().map(str::trim) {
        let option = line.strip_prefix("# ").filter(|l| {
            l.split_once('=').is_some_and(|(k, _)| {
                let k = k.trim();
                !k.is_empty()
                    && k.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            })
        });
        match option {
            Some(setting) if !example => {
                uncommented.push_str(setting);
                uncommented.push('\n');
                shown += 1;
            }
            Some(_) => example = false,
            None if line.contains("Default:") => example = true,
            None if line.starts_with('[') => {
                uncommented.push_str(line);
                uncommented.push('\n');
            }
            None => {}
        }
    }
    assert!(shown > 80, "{shown} options shown with their defaults");
    let ours: Config = toml::from_str(&uncommented).unwrap();
    let json = |c: &Config| serde_json::to_value(c).unwrap();
    let (ours, defaults) = (json(&ours), json(&Config::default()));
    let table: toml::Table = uncommented.parse().unwrap();
    for (section, options) in table {
        for (option, _) in options.as_table().unwrap() {
            assert_eq!(
                ours[&section][option], defaults[&section][option],
                "[{section}]{option}: the sample's value is not the default"
            );
        }
    }
}
