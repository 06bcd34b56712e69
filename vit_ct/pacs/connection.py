"""A DICOMweb server as vit-ct reaches it: a ``dicomweb-client`` client with credentials from the environment only
(never the command line, where ``ps`` and shell histories show them: a URL with ``user:password@`` is refused, its
password masked in the message), and each way of failing to reach it as a named error that says which URL and what
was expected. A query of several requests (a QIDO-RS search's pages) has a deadline for all of them together.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from urllib.parse import urlsplit

TOKEN = "VIT_CT_DICOMWEB_TOKEN"  # sent as `Authorization: Bearer <token>`
USER, PASSWORD = "VIT_CT_DICOMWEB_USER", "VIT_CT_DICOMWEB_PASSWORD"  # HTTP basic auth
TIMEOUT_S = 30.0
ATTEMPTS = 3


class PacsError(Exception):
    """A DICOMweb server could not do what vit-ct asked; the message names the URL and what was expected."""


class ServerUnreachable(PacsError):
    """Nothing answered at the URL: the server is down, the port or host is wrong, or the connection was refused."""


class AccessRefused(PacsError):
    """The server answered HTTP 401 or 403: no credentials, wrong ones, or an account without the right."""


class ServerTimeout(PacsError):
    """The server accepted the connection but did not answer within the timeout."""


class DeadlinePassed(ServerTimeout):
    """A query of several requests (a QIDO-RS search, page by page) did not end within its seconds, all together."""


class NotDicomWeb(PacsError):
    """The server answered, but not as a DICOMweb service does: not DICOM JSON, or results other than those asked for
    (as the root of Orthanc's own REST API answers, instead of its DICOMweb root ``.../dicom-web``)."""


class OffsetIgnored(PacsError):
    """A search's next page (QIDO-RS ``offset``) brought back only results of earlier pages: paging would not end."""


class TooManyResults(PacsError):
    """A search found more results than what was asked for can hold (e.g. more series than a study plausibly has)."""


class StudyNotFound(PacsError):
    """The server holds no study with the StudyInstanceUID asked for."""


class NoCTSeries(PacsError):
    """The study is there but holds no series of Modality CT."""


def credentials(environ: Mapping[str, str] | None = None) -> tuple[dict[str, str], tuple[str, str] | None, str]:
    """(headers, basic auth, what was sent in words) from ``VIT_CT_DICOMWEB_TOKEN`` or ``VIT_CT_DICOMWEB_USER`` with
    ``VIT_CT_DICOMWEB_PASSWORD``; neither: no credentials. Both kinds, or a user without a password, is refused."""
    environ = os.environ if environ is None else environ
    token, user, password = (environ.get(name, "") for name in (TOKEN, USER, PASSWORD))
    if token and (user or password):
        raise ValueError(f"both {TOKEN} and {USER}/{PASSWORD} are set: set only one kind of DICOMweb credentials")
    if bool(user) != bool(password):
        missing = PASSWORD if user else USER
        raise ValueError(f"{USER} and {PASSWORD} go together: {missing} is not set")
    if token:
        return {"Authorization": f"Bearer {token}"}, None, f"a bearer token from {TOKEN}"
    if user:
        return {}, (user, password), f"basic auth as user {user!r} from {USER}/{PASSWORD}"
    return {}, None, f"no credentials (none of {TOKEN}, {USER}/{PASSWORD} is set)"


def masked_url(url: str) -> str:
    """``url`` with its user info (what comes before ``@`` after the scheme) masked: ``http://alice:***@host/x``; a
    user info without ``:`` is masked whole (``http://***@host/x``), as it may be a token itself. Everything up to
    the last ``@`` counts, so a password with ``/``, ``@`` or ``#`` in it is masked whole too; so does a URL without
    a scheme (``alice:secret@host``)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    if "@" not in rest:
        return url
    info, _, after = rest.rpartition("@")
    user, colon, _ = info.partition(":")
    shown = f"{user}:***" if colon and user and not set(user) & set("/?#[]") else "***"
    return f"{scheme}{sep}{shown}@{after}"


def checked_url(url: str) -> str:
    """``url`` without a trailing ``/`` if it is an http(s) URL without user info, else a ValueError that names it
    with the user info masked (:func:`masked_url`)."""
    if "@" in url:  # any "@", not only urlsplit's user info: it takes "http://a:p/w@host" for host "a", port "p"
        raise ValueError(
            f"DICOMweb URL {masked_url(url)} holds user info (user:password@); vit-ct takes credentials from the "
            f"environment only (a URL shows in ps, shell histories and logs): set {USER} and {PASSWORD} (basic auth) "
            f"or {TOKEN} (bearer), and give the URL without them, e.g. http://host:8042/dicom-web"
        )
    scheme = urlsplit(url).scheme
    if scheme not in ("http", "https"):
        got = f"scheme {scheme!r}" if "://" in url else "no scheme"
        raise ValueError(f"DICOMweb URL {url!r} has {got}; expected an http:// or https:// URL, e.g. "
                         "http://localhost:8042/dicom-web")  # fmt: skip
    return url.rstrip("/")


class _DeadlineReached(BaseException):
    """Raised by a :func:`_deadline_session` request the deadline stopped, and turned into :class:`DeadlinePassed` by
    :meth:`Server.query`. A BaseException, because ``dicomweb-client`` tries a request again on any Exception after
    waiting 2, 4, ... s: past the deadline that would only wait."""


def _deadline_session():
    """A ``requests`` session whose requests, while its ``budget`` (seconds) is set, end within that many seconds of
    the first one's start (its ``deadline``, ``time.monotonic()`` seconds): each waits no longer than what is left,
    and one that times out for that, or would start after it, raises :class:`_DeadlineReached`. The first request
    waits its whole timeout where the budget is as long, so a server that never answers is a plain timeout. Built
    here, not at import: ``vit-ct pacs --help`` imports no ``requests``."""
    import requests

    class DeadlineSession(requests.Session):
        budget: float | None = None
        deadline: float | None = None

        def request(self, method, url, *args, **kwargs):
            if self.budget is None:
                return super().request(method, url, *args, **kwargs)
            now = time.monotonic()
            if self.deadline is None:
                self.deadline = now + self.budget
            left = self.deadline - now
            if left <= 0:
                raise _DeadlineReached
            timeout = kwargs.get("timeout")  # dicomweb-client passes it by name: a number or (connect, read)
            limits = timeout if isinstance(timeout, tuple) else (timeout, timeout)
            cut = tuple(left if t is None else min(t, left) for t in limits)
            kwargs["timeout"] = cut if isinstance(timeout, tuple) else cut[0]
            try:
                return super().request(method, url, *args, **kwargs)
            except requests.exceptions.Timeout:
                if cut != limits:  # it waited only what was left
                    raise _DeadlineReached from None
                raise

    return DeadlineSession()


class Server:
    """One DICOMweb service (e.g. Orthanc's ``http://host:8042/dicom-web``) and the client that talks to it.

    Args:
        url: The service's root, under which ``studies``, ``series`` and ``instances`` are: http or https, without
            user info (a ValueError names the URL with its password masked; credentials come from ``environ``).
        timeout_s: Seconds to wait for a connection and, separately, for each answer.
        attempts: Tries of each request before its error is raised: a connection that fails or times out, and the
            answers 429, 503 and 504, are tried again after 2, 4, ... s (``dicomweb-client``'s backing off).
        environ: Where credentials are read (default ``os.environ``).
        query_s: Seconds one query of several requests (:meth:`query`: a QIDO-RS search, all its pages) may take
            in all (default ``timeout_s``): each request is cut to what is left of them.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = TIMEOUT_S,
        attempts: int = ATTEMPTS,
        environ: Mapping[str, str] | None = None,
        query_s: float | None = None,
    ) -> None:
        from dicomweb_client.api import DICOMwebClient

        self.url = checked_url(url)  # never holds credentials, so no message naming it can show them
        self.timeout_s = timeout_s
        self.query_s = timeout_s if query_s is None else query_s
        headers, auth, self.sent = credentials(environ)
        self.session = _deadline_session()
        self.session.auth = auth
        try:
            self.client = DICOMwebClient(self.url, session=self.session, headers=headers, timeout=timeout_s)
        except ValueError as err:  # a malformed URL
            raise ValueError(f"DICOMweb URL {url!r}: {err}; expected e.g. http://localhost:8042/dicom-web") from err
        self.attempts = attempts
        self.client.set_http_retry_params(retry=attempts > 1, max_attempts=attempts)

    @property
    def _tries(self) -> str:
        return "1 try" if self.attempts == 1 else f"{self.attempts} tries"

    @property
    def root_hint(self) -> str:
        """Words asking whether the URL is the DICOMweb root; a server's bare root gets Orthanc's under it."""
        if not urlsplit(self.url).path.strip("/"):
            return f"{self.url} is a server's root, not a DICOMweb root: for Orthanc that is {self.url}/dicom-web"
        return "is the URL the DICOMweb root, e.g. http://host:8042/dicom-web for Orthanc?"

    @contextlib.contextmanager
    def query(self, what: str) -> Iterator[None]:
        """:meth:`asking` for a query of several requests (e.g. a QIDO-RS search's pages), all of them within
        ``query_s`` seconds together: each request waits no longer than what is left, none starts after it (nor do
        ``dicomweb-client``'s tries again), and :meth:`in_time` checks it between requests: :class:`DeadlinePassed`."""
        self.session.budget, self.session.deadline = self.query_s, None  # the deadline: from the first request on
        try:
            with self.asking(what):
                yield
        except _DeadlineReached:
            raise DeadlinePassed(self._late(what)) from None
        finally:
            self.session.budget = self.session.deadline = None

    def in_time(self, what: str, done: str = "") -> None:
        """:class:`DeadlinePassed` if the deadline of the :meth:`query` under way has passed; ``done``: how far the
        query got (e.g. "3 pages, 300 results"), for the message."""
        deadline = self.session.deadline
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlinePassed(self._late(what, done))

    def _late(self, what: str, done: str = "") -> str:
        got = f" (it had answered {done})" if done else ""
        return (
            f"{self.url} did not finish answering {what} within {self.query_s:g} s, all its requests together{got}; "
            "expected a DICOMweb server that answers a query in time (is it overloaded? a longer --timeout waits more)"
        )

    @contextlib.contextmanager
    def asking(self, what: str) -> Iterator[None]:
        """Turns the ways a request fails into the named errors, each message naming the URL and ``what`` was asked
        (e.g. "the CT series of study 1.2.3 (QIDO-RS)")."""
        import requests

        try:
            yield
        except requests.exceptions.Timeout as err:  # before ConnectionError: ConnectTimeout is both
            raise ServerTimeout(
                f"{self.url} did not answer within {self.timeout_s:g} s ({self._tries}) while vit-ct asked for {what}; "
                "expected a DICOMweb server that answers (is it overloaded? a longer --timeout waits more)"
            ) from err
        except requests.exceptions.ConnectionError as err:
            raise ServerUnreachable(
                f"cannot reach {self.url} to ask for {what}: {_reason(err)} ({self._tries}); expected a DICOMweb "
                "server listening there (is it running? are its host, port and path right, e.g. "
                "http://localhost:8042/dicom-web?)"
            ) from err
        except requests.exceptions.HTTPError as err:
            status = err.response.status_code if err.response is not None else None
            if status in (401, 403):
                words = "refused vit-ct's credentials" if status == 401 else "refused access"
                raise AccessRefused(
                    f"{self.url} {words} (HTTP {status}) when asked for {what}; vit-ct sent {self.sent}. Expected "
                    f"credentials the server accepts: set {TOKEN} (bearer) or {USER} and {PASSWORD} (basic)"
                ) from err
            raise PacsError(
                f"{self.url} answered HTTP {status} {_body(err.response)} when asked for {what}; expected a DICOMweb "
                f"answer ({self.root_hint})"
            ) from err
        except requests.exceptions.InvalidJSONError as err:  # an HTML page, say: what a web server's root answers
            raise NotDicomWeb(
                f"{self.url} answered {what} with something that is not JSON ({err}); expected DICOM JSON "
                f"({self.root_hint})"
            ) from err


def _reason(err: Exception) -> str:
    """The innermost reason of a requests error in a few words (e.g. "[Errno 111] Connection refused")."""
    while err.__context__ is not None and not isinstance(err.__context__, type(err)):
        err = err.__context__
    text = str(err)
    return text.rsplit(": ", 1)[-1].rstrip("')\"") if "Errno" in text else text


def _body(response) -> str:
    """The start of an error answer's text, for the message."""
    if response is None or not response.content:
        return ""
    return repr(response.content[:200].decode("utf-8", "replace").strip())
