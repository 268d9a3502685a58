"""``-hf REPO[:QUANT]`` online: fetch a repository's model into the Hugging Face hub
cache, as llama-server does, so that either program later finds it there.

What llama.cpp (October 2026: ``common/hf-cache.cpp``, ``common/download.cpp``,
``common_models_handler_apply`` in ``common/arg.cpp``) does, and this module too:

- The endpoint is ``$MODEL_ENDPOINT``, else ``$HF_ENDPOINT``, else
  ``https://huggingface.co/``, always with a trailing ``/``.
- ``GET <endpoint>api/models/<repo>/refs`` gives the branches; ``main`` is taken, else
  the first valid one, and its commit is written to ``refs/<branch>`` of the
  repository's cache directory (``models--<owner>--<name>``).
- ``GET <endpoint>api/models/<repo>/tree/<commit>?recursive=true`` lists the files;
  each has a ``path`` and an object id: the LFS ``oid`` (a sha256) when the file is in
  LFS, else the git ``oid``.
- The model file is picked by ``hf_cache.pick`` (``-hff``, else the quant tag, else
  Q4_K_M, Q8_0, the first model file), with every part of a split model. Unless
  ``--no-mmproj``, ``--mmproj`` or ``--mmproj-url`` says otherwise, the repository's
  projector for that file is fetched too (``hf_cache.best_mmproj``).
- Each file is downloaded from ``<endpoint><repo>/resolve/<commit>/<path>`` (the hub
  answers with a redirect to its CDN) to ``blobs/<oid>``: a blob that is there is
  used without a request, no ``.etag`` sidecar (the name is the version). Once every
  file is there, ``snapshots/<commit>/<path>`` becomes a relative symbolic link to its
  blob; where links cannot be made, the blob is moved there instead (copied if that
  fails).
- The API requests carry the token (``-hft``, ``HF_TOKEN``) only when it looks like
  a Hugging Face token (``hf_`` and letters or digits, 37 to 256 characters), the file
  downloads carry any token given.

Where this differs on purpose:

- A model that is already in the cache, every part of it, is used without a
  request (llama-server asks the API at every start and takes a newer commit when
  there is one): a start does not depend on the hub answering, and a second start
  costs nothing. The price: a repository updated upstream is not followed until its
  cache directory is removed, and a projector is not fetched later for a model that
  an earlier ``--no-mmproj`` start put in the cache.
- Failures end the start with one line naming the repository and what went wrong
  (no such repository, no file for the quant with the repository's GGUF files
  listed, the network, an unwritable cache); llama-server falls back to the cache
  and then says only "no GGUF files found". The API requests are retried as the
  file downloads are (llama.cpp asks once).
- Files are fetched one after the other (llama.cpp runs them in parallel), each with
  ``model/download.py`` (resume, retries, size check).
- A path in the listing is percent-encoded in its URL; a ``preset.ini`` repository
  (llama-server's router mode) is not special here.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import attrs

from trio_llm import __version__
from trio_llm.errors import ModelLoadError
from trio_llm.model import hf_cache
from trio_llm.model.download import Progress, masked_url, retryable, trio_pause

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co/"
#: how many of a repository's GGUF files an error about a missing quant names
LISTED = 12

_SPLIT = re.compile(r"^(.+)-(\d{5})-of-(\d{5})$", re.IGNORECASE)
_REPO_ID = re.compile(r"^[A-Za-z0-9_]+(?:[/.-][A-Za-z0-9_]+)*$")
_TOKEN = re.compile(r"^hf_[A-Za-z0-9]+$")
_COMMIT = re.compile(r"^[0-9a-fA-F]{40}$")
_OID = re.compile(r"^(?:[0-9a-fA-F]{40}|[0-9a-fA-F]{64})$")


class HubError(ModelLoadError):
    """``-hf``: the repository could not be listed, or holds no file for the request.
    ``status`` is the HTTP status that ended it, when one did. One line; the CLI
    prints it and exits 1."""

    def __init__(self, spec: str, problem: str, status: int | None = None) -> None:
        self.status = status
        super().__init__(spec, problem)


@attrs.frozen
class RepoFile:
    """One file of a repository's listing at a commit."""

    path: str  # relative, "/"-separated
    oid: str  # the LFS sha256, else the git object id; "" when the listing gave none
    url: str  # <endpoint><repo>/resolve/<commit>/<path>


@attrs.frozen
class Listing:
    repo: str
    commit: str
    files: tuple[RepoFile, ...]

    def paths(self) -> list[str]:
        return [f.path for f in self.files]


@attrs.frozen
class Fetched:
    """What ``-hf`` gives the server: the model file (the first part of a split model)
    and the projector, both in the cache."""

    model: Path
    mmproj: Path | None = None


def model_endpoint(env: Mapping[str, str]) -> str:
    """llama.cpp's ``common_get_model_endpoint``."""
    endpoint = env.get("MODEL_ENDPOINT") or env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
    return endpoint if endpoint.endswith("/") else endpoint + "/"


def valid_repo_id(repo: str) -> bool:
    """``owner/name`` of letters, digits and ``_``, with single ``.``, ``-`` or ``/``
    between them, one ``/``, at most 256 characters (llama.cpp's ``is_valid_repo_id``)."""
    return 0 < len(repo) <= 256 and repo.count("/") == 1 and _REPO_ID.match(repo) is not None


def api_token(token: str | None) -> str | None:
    """The token the API requests carry: only one shaped as a Hugging Face token, as
    llama.cpp's ``is_valid_hf_token`` (it warns and sends none otherwise)."""
    if not token:
        return None
    if 37 <= len(token) <= 256 and _TOKEN.match(token):
        return token
    log.warning("-hf: the token does not look like a Hugging Face token (hf_...): the API requests go "
                "without it")
    return None


def split_info(path: str) -> tuple[str, int, int] | None:
    """``(prefix, index, count)`` of a GGUF file name (``m-Q4_K_M-00002-of-00003.gguf``:
    ``("m-Q4_K_M", 2, 3)``; a file in one piece is part 1 of 1), None for another file."""
    if not path.endswith(".gguf"):
        return None
    prefix = path[: -len(".gguf")]
    m = _SPLIT.match(prefix)
    if m is None:
        return prefix, 1, 1
    return m.group(1), int(m.group(2)), int(m.group(3))


def split_parts(files: Sequence[str], primary: str) -> list[str]:
    """Every part of ``primary``'s split model among ``files`` (``[primary]`` for a
    file in one piece), as llama.cpp's ``get_split_files``."""
    info = split_info(primary)
    if info is None or info[2] <= 1:
        return [primary]
    return [f for f in files if (i := split_info(f)) is not None and (i[0], i[2]) == (info[0], info[2])]


def _complete(model: Path) -> bool:
    """Whether every part of a cached model file (the first part of a split one) is
    there beside it."""
    info = split_info(model.name)
    if info is None or info[2] <= 1:
        return True
    return all((model.parent / f"{info[0]}-{i:05d}-of-{info[2]:05d}.gguf").is_file()
               for i in range(1, info[2] + 1))


def from_cache(spec: str, hf_file: str | None, env: Mapping[str, str], mmproj: bool) -> Fetched | None:
    """The model (every part of it there) and projector of ``-hf spec`` from the local
    cache (``hf_cache.resolve``), or None."""
    try:
        model = hf_cache.resolve(spec, hf_file, env)
    except hf_cache.NotCached:
        return None
    if not _complete(model):
        return None
    return Fetched(model, hf_cache.find_mmproj(model, spec) if mmproj else None)


def fetch(spec: str, hf_file: str | None = None, *, mmproj: bool = True, token: str | None = None,
          env: Mapping[str, str] | None = None, progress: Progress | None = None, attempts: int = 3,
          retry_delay: float = 1.0, timeout: float = 30.0,
          pause: Callable[[float], None] = trio_pause) -> Fetched:
    """``-hf spec`` (``-hff hf_file``) online: from the cache when it is all there,
    else listed through the endpoint's API and downloaded into the hub cache (see the
    module docstring). ``mmproj``: fetch the repository's projector too. Blocking: run
    it on a trio worker thread; ``pause``, ``progress``, ``attempts``, ``retry_delay``
    and ``timeout`` are ``download``'s."""
    from trio_llm.model.download import download

    env = os.environ if env is None else env
    cached = from_cache(spec, hf_file, env, mmproj)
    if cached is not None:
        log.debug("-hf %s: %s, from the cache", spec, cached.model)
        return cached
    repo, tag = hf_cache.split_repo_tag(spec)
    if not valid_repo_id(repo):
        raise HubError(spec, f"-hf: {repo!r} is not a valid repository name (owner/name)")
    repo_dir = hf_cache.hub_cache_dir(env) / ("models--" + repo.replace("/", "--"))
    attempts = max(1, attempts)
    listing = list_repo(spec, repo_dir, model_endpoint(env), token=token, attempts=attempts,
                        retry_delay=retry_delay, timeout=timeout, pause=pause)
    paths = listing.paths()
    primary = hf_cache.pick(paths, tag, hf_file)
    if primary is None:
        raise HubError(spec, "-hf: " + _nothing_for(repo, tag, hf_file, paths))
    wanted = split_parts(paths, primary)
    projector = hf_cache.best_mmproj(paths, primary) if mmproj else None
    if projector is not None:
        wanted.append(projector)
    by_path = {f.path: f for f in listing.files}
    snapshot = repo_dir / "snapshots" / listing.commit
    blobs: list[tuple[Path, Path]] = []
    for path in wanted:
        f = by_path[path]
        final = snapshot / path
        local = repo_dir / "blobs" / f.oid if f.oid and not final.exists() else final
        log.info("-hf %s: %s", spec, path)
        download(f.url, local, token=token, progress=progress, attempts=attempts, retry_delay=retry_delay,
                 timeout=timeout, pause=pause, sidecar=False)
        blobs.append((local, final))
    for local, final in blobs:  # once all are there, as llama.cpp: a failure leaves no half model
        finalize(local, final)
    log.info("-hf %s: %s in %s", spec, primary, snapshot)
    return Fetched(snapshot / primary, snapshot / projector if projector is not None else None)


def _nothing_for(repo: str, tag: str, hf_file: str | None, paths: Sequence[str]) -> str:
    ggufs = [p for p in paths if p.endswith(".gguf")]
    what = f"no file {hf_file}" if hf_file else f"no GGUF model file for quant {tag}" if tag else "no GGUF model file"
    if not ggufs:
        return f"{what} in repository {repo}: it has no GGUF file"
    shown = ", ".join(ggufs[:LISTED]) + (f" and {len(ggufs) - LISTED} more" if len(ggufs) > LISTED else "")
    return f"{what} in repository {repo}; its GGUF files: {shown}"


def list_repo(spec: str, repo_dir: Path, endpoint: str, *, token: str | None = None, attempts: int = 3,
              retry_delay: float = 1.0, timeout: float = 30.0,
              pause: Callable[[float], None] = trio_pause) -> Listing:
    """The repository's branch commit (written to ``repo_dir/refs/<branch>``) and its
    file listing at that commit, from the endpoint's API."""
    import httpx

    repo = hf_cache.split_repo_tag(spec)[0]
    headers = {"User-Agent": f"trio-llm/{__version__}", "Accept": "application/json"}
    auth = api_token(token)
    if auth:
        headers["Authorization"] = f"Bearer {auth}"
    with httpx.Client(headers=headers, timeout=timeout, follow_redirects=True) as client:
        def get(url: str) -> Any:
            return _api_get(client, spec, url, attempts, retry_delay, pause)

        refs = get(f"{endpoint}api/models/{repo}/refs")
        branch, commit = _branch(spec, refs)
        _write_ref(spec, repo_dir / "refs" / branch, commit)
        tree = get(f"{endpoint}api/models/{repo}/tree/{commit}?recursive=true")
    if not isinstance(tree, list):
        raise HubError(spec, f"-hf: the file listing of {repo} is not a JSON array")
    files = []
    for item in tree:
        if not isinstance(item, dict) or item.get("type") != "file" or not isinstance(item.get("path"), str):
            continue
        path = item["path"]
        pure = PurePosixPath(path)
        if not path or pure.is_absolute() or ".." in pure.parts or "\\" in path:
            log.warning("-hf %s: a file path that leaves the snapshot is skipped: %r", repo, path)
            continue
        lfs = item.get("lfs")
        oid = lfs.get("oid") if isinstance(lfs, dict) else item.get("oid")
        oid = oid if isinstance(oid, str) else ""
        if oid and not _OID.match(oid):
            log.warning("-hf %s: %s has an invalid object id, skipped", repo, path)
            continue
        files.append(RepoFile(path, oid, f"{endpoint}{repo}/resolve/{commit}/{quote(path)}"))
    return Listing(repo, commit, tuple(files))


def _branch(spec: str, refs: Any) -> tuple[str, str]:
    """``main``'s commit, else the first valid branch's (llama.cpp's ``get_repo_commit``)."""
    branches = refs.get("branches") if isinstance(refs, dict) else None
    if not isinstance(branches, list):
        raise HubError(spec, "-hf: the repository's refs have no branches")
    found: tuple[str, str] | None = None
    for b in branches:
        if not isinstance(b, dict):
            continue
        name, commit = b.get("name"), b.get("targetCommit")
        if not isinstance(name, str) or not isinstance(commit, str) or not _COMMIT.match(commit):
            continue
        pure = PurePosixPath(name)
        if not name or pure.is_absolute() or ".." in pure.parts:
            continue
        if name == "main":
            return name, commit
        found = found or (name, commit)
    if found is None:
        raise HubError(spec, "-hf: the repository has no valid branch")
    return found


def _write_ref(spec: str, ref: Path, commit: str) -> None:
    """``ref`` holds ``commit`` (replaced atomically); an unwritable cache is the error
    that ends the start."""
    tmp = ref.with_name(ref.name + ".tmp")
    try:
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(commit, encoding="ascii")
        os.replace(tmp, ref)
    except OSError as exc:
        raise HubError(spec, f"-hf: cannot write the cache at {ref.parent.parent}: {exc.strerror or exc}") from None


def _api_get(client: httpx.Client, spec: str, url: str, attempts: int, retry_delay: float,
             pause: Callable[[float], None]) -> Any:
    """The JSON of one API request, retried as ``download`` retries (a 5xx, 408, 429 or
    no answer); an error that names the repository otherwise."""
    import httpx

    shown = masked_url(url)
    repo = hf_cache.split_repo_tag(spec)[0]
    why = ""
    for attempt in range(attempts):
        if attempt:
            seconds = retry_delay * 2 ** (attempt - 1)
            log.warning("%s: %s; retrying in %.3g s (attempt %d of %d)", shown, why, seconds, attempt + 1, attempts)
            pause(seconds)
        try:
            r = client.get(url)
        except httpx.HTTPError as exc:
            why = f"{type(exc).__name__}: {str(exc).replace(url, shown)}".rstrip(": ")
            continue
        if r.status_code == 200:
            try:
                return r.json()
            except ValueError:
                raise HubError(spec, f"-hf: {shown} answered something other than JSON") from None
        status = r.status_code
        why = f"HTTP {status}{_error_text(r)}"
        if retryable(status):
            continue
        if status == 404 or r.headers.get("X-Error-Code") in ("RepoNotFound", "RevisionNotFound"):
            hint = "" if token_sent(client) else " (a private or gated one needs a token: -hft or HF_TOKEN)"
            raise HubError(spec, f"-hf: repository {repo} not found at {shown} ({why}){hint}", status)
        if status in (401, 403):
            hint = "the token is not allowed to read it" if token_sent(client) else \
                "a private or gated repository needs a token: -hft or HF_TOKEN"
            raise HubError(spec, f"-hf: {shown}: {why}: {hint}", status)
        raise HubError(spec, f"-hf: {shown}: {why}", status)
    raise HubError(spec, f"-hf: cannot list repository {repo}: {shown}: failed after {attempts} attempts: {why} "
                         "(--offline uses the local cache only)")


def token_sent(client: httpx.Client) -> bool:
    return "Authorization" in client.headers


def _error_text(r: httpx.Response) -> str:
    """``: <the hub's "error" field>`` of an error answer, or ""."""
    try:
        body = r.json()
    except ValueError:
        return ""
    text = body.get("error") if isinstance(body, dict) else None
    return f": {' '.join(text.split())[:200]}" if isinstance(text, str) and text else ""


def finalize(local: Path, final: Path) -> Path:
    """``final`` (a snapshot's path) for the downloaded ``local`` (its blob): a relative
    symbolic link to it, else the blob moved there, else copied (llama.cpp's
    ``finalize_file``). Nothing to do when they are the same or ``final`` exists."""
    import shutil

    if local == final or final.exists():
        return final
    try:
        if final.is_symlink():  # a link to a blob that is gone
            final.unlink()
        final.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(local, final.parent), final)
        return final
    except OSError as exc:
        log.warning("-hf: cannot link %s to its blob (%s): moving the file there", final, exc.strerror or exc)
    try:
        os.replace(local, final)
    except OSError:
        try:
            shutil.copyfile(local, final)
        except OSError as exc:
            raise ModelLoadError(final, f"cannot put the downloaded file in the snapshot: {exc.strerror or exc}") \
                from None
    return final
