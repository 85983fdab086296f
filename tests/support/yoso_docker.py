"""The Docker engine, the Debian base image and this machine's package sources, for the tests that build
and run the image on a real engine (tests/deploy/test_docker_engine.py)."""

from __future__ import annotations

import ast
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path

import pytest


class Docker:
    """One docker CLI talking to one engine."""

    def __init__(self, cli: str, host: str | None):
        self.cli = cli
        self.owned = False  # True for a dockerd this session started (and so may prune)
        self.env = {**os.environ, "DOCKER_BUILDKIT": "1"}
        if host:
            self.env["DOCKER_HOST"] = host

    def __call__(self, *args, timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
        done = subprocess.run([self.cli, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                              env=self.env, **kw)
        if check and done.returncode != 0:
            pytest.fail(f"docker {' '.join(map(str, args))[:200]}: exit {done.returncode}\n{done.stderr[-3000:]}")
        return done

    def up(self) -> bool:
        return self("version", "--format", "{{.Server.Version}}", check=False, timeout=20).returncode == 0


def buildkit_cli() -> str | None:
    """A docker CLI that builds with BuildKit: one with the buildx plugin, or a client older than 23 (BuildKit
    built in, DOCKER_BUILDKIT=1). Newer clients without buildx refuse BuildKit builds."""
    found = []
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        cli = Path(folder) / "docker"
        if cli.is_file() and os.access(cli, os.X_OK) and cli.resolve() not in found:
            found.append(cli.resolve())
    for cli in found:
        if subprocess.run([cli, "buildx", "version"], capture_output=True, timeout=20).returncode == 0:
            return str(cli)
        version = subprocess.run([cli, "version", "--format", "{{.Client.Version}}"], capture_output=True,
                                 text=True, timeout=20).stdout.strip()
        if re.match(r"(1\d|2[0-2])\.", version):
            return str(cli)
    return None



# --- the base image: Debian from the mirror this machine's apt uses ------------------------------------

def debian_sources(codename: str) -> list[tuple[str, str]]:
    """(URI, suite) of the enabled `deb` entries with component main for ``codename`` (and its -updates and
    -security) in this machine's apt sources, one-line and deb822 formats alike."""
    apt = Path("/etc/apt")
    entries: list[tuple[str, list[str], list[str]]] = []
    for path in [apt / "sources.list", *sorted(apt.glob("sources.list.d/*.list"))]:
        for line in path.read_text().splitlines() if path.is_file() else []:
            words = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()
            if len(words) >= 4 and words[0] == "deb":
                entries.append((words[1], [words[2]], words[3:]))
    for path in sorted(apt.glob("sources.list.d/*.sources")):
        for stanza in re.split(r"\n\s*\n", path.read_text()):
            fields, key = {}, None
            for line in stanza.splitlines():
                if line.startswith("#") or not line.strip():
                    continue
                if line[0].isspace() and key:
                    fields[key] += " " + line.strip()
                else:
                    key, _, value = line.partition(":")
                    key = key.strip().lower()
                    fields[key] = value.strip()
            if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes").lower() != "no":
                for uri in fields.get("uris", "").split():
                    entries.append((uri, fields.get("suites", "").split(), fields.get("components", "").split()))
    wanted = (codename, f"{codename}-updates", f"{codename}-security")
    return [(uri, s) for uri, suites, comps in entries for s in suites if s in wanted and "main" in comps]


# The slim variant's habits: no documentation, manuals or translations, no downloaded packages kept.
DPKG_SLIM = """path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
"""
APT_SLIM = 'APT::Keep-Downloaded-Packages "false";\nAcquire::Languages "none";\n'


def slim_rootfs(rootfs: Path, sources: list[tuple[str, str]]) -> None:
    (rootfs / "etc/dpkg/dpkg.cfg.d/slim").write_text(DPKG_SLIM)
    (rootfs / "etc/apt/apt.conf.d/slim").write_text(APT_SLIM)
    for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*",
                    "usr/share/man/*", "usr/share/info/*", "usr/share/locale/*"):
        for path in rootfs.glob(pattern):
            if path.name != "locale.alias":
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    for path in (rootfs / "usr/share/doc").rglob("*"):
        if not path.is_dir() and path.name != "copyright":
            path.unlink()
    if sources:  # the image's apt reads the mirrors the machine's apt reads, security updates included
        (rootfs / "etc/apt/sources.list").write_text("".join(f"deb {u} {s} main\n" for u, s in sources))


def debian_base(docker: Docker, tag: str, rootfs: Path) -> str:
    """Tag ``tag`` (debian:<codename>-slim) from a debootstrap minbase made in ``rootfs`` (removed after),
    unless the engine has it or can pull it. Returns how it came."""
    if docker("image", "inspect", tag, check=False).returncode == 0:
        return "cached"
    if docker("pull", tag, check=False, timeout=600).returncode == 0:  # where a registry answers
        return "pulled"
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        pytest.fail(f"{tag} is not on the engine and debootstrap is missing: bash deploy/install-system-deps.sh")
    codename = tag.split(":")[1].removesuffix("-slim")
    sources = debian_sources(codename)
    mirror = [u for u, s in sources if s == codename][:1]  # none: debootstrap's own default mirror
    shutil.rmtree(rootfs, ignore_errors=True)
    made = subprocess.run([debootstrap, "--variant=minbase", codename, str(rootfs), *mirror],
                          capture_output=True, text=True, timeout=1200)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    slim_rootfs(rootfs, sources)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
    docker("import", "--change", 'CMD ["bash"]', "--change", "LABEL made-by=debootstrap-minbase", "-", tag,
           stdin=tar.stdout, timeout=600)
    assert tar.wait(timeout=60) == 0
    shutil.rmtree(rootfs)
    return f"made with debootstrap from {mirror[0] if mirror else 'its default mirror'}"


# --- the build: this machine's pip sources, local folders served on loopback ----------------------------

class _Files(http.server.SimpleHTTPRequestHandler):
    """Read-only files under ``roots``, by absolute path; nothing else (404)."""

    roots: tuple[Path, ...] = ()

    def translate_path(self, path: str) -> str:
        wanted = Path(os.path.normpath(urllib.parse.unquote(urllib.parse.urlsplit(path).path)))
        inside = any(wanted == r or r in wanted.parents for r in self.roots)
        return str(wanted) if inside else "/nonexistent"

    def log_message(self, *args) -> None:
        pass


class PackageSources:
    """This machine's pip sources (``pip config list``: its files and PIP_* variables) as a pip.conf for the
    build: URLs as they are, local folders (file:// indexes, find-links) served read-only on 127.0.0.1 for
    a build on the host network, and the CA bundle pip trusts (a TLS-intercepting proxy's) as the pip-ca
    secret. Where packages come from travels; pip's other settings (constraints, timeouts) do not."""

    KEYS = ("index-url", "extra-index-url", "find-links", "no-index", "trusted-host", "cert")
    CA = "/run/secrets/pip-ca"  # where the Dockerfile mounts the pip-ca secret

    def __init__(self, conf: Path):
        listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                                text=True, timeout=60, check=True).stdout
        found: dict[str, dict[str, str]] = {}
        for line in listed.splitlines():  # global.find-links='/opt/wheels', :env:.find-links='...'
            m = re.fullmatch(r"(:env:|[\w-]+)\.([\w-]+)=(.*)", line.strip())
            if m and m[2] in self.KEYS:
                found.setdefault(m[2], {})[m[1]] = ast.literal_eval(m[3])
        # pip's precedence: environment over the [install] section over [global]
        self.settings = {key: next(by[s] for s in (":env:", "install", "global") if s in by)
                         for key, by in found.items() if by.keys() & {":env:", "install", "global"}}
        self.ca = self.settings.pop("cert", None)
        self.conf, self.roots = conf, []

    def secrets(self) -> list[str]:
        """The ``docker build`` flags that hand pip.conf (and the CA bundle) to the build."""
        return [f"--secret=id=pip.conf,src={self.conf}"] + ([f"--secret=id=pip-ca,src={self.ca}"] if self.ca else [])

    def _location(self, key: str, value: str, port: int) -> str:
        if "://" in value and not value.startswith("file://"):
            return value
        path = Path(urllib.parse.unquote(urllib.parse.urlsplit(value).path) if "://" in value else value)
        # an index's pages link to files beside it (../../files/...); a find-links folder lists its own
        self.roots.append(path if key == "find-links" and path.is_dir() else path.parent)
        return f"http://127.0.0.1:{port}{urllib.parse.quote(str(path))}"

    def __enter__(self) -> PackageSources:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
        port = self.server.server_address[1]
        lines = ["[global]"]
        for key, value in self.settings.items():
            if key in ("index-url", "extra-index-url", "find-links"):
                value = " ".join(self._location(key, v, port) for v in value.split())
            lines.append(f"{key} = {value}")
        if self.ca:
            lines.append(f"cert = {self.CA}")
        _Files.roots = tuple(self.roots)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.conf.write_text("\n".join(lines) + "\n")
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
