"""A DICOMweb server as vit-ct reaches it: a ``dicomweb-client`` client with credentials from the environment only
(never the command line, where ``ps`` and shell histories show them), and each way of failing to reach it as a named
error that says which URL and what was expected.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

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


class Server:
    """One DICOMweb service (e.g. Orthanc's ``http://host:8042/dicom-web``) and the client that talks to it.

    Args:
        url: The service's root, under which ``studies``, ``series`` and ``instances`` are.
        timeout_s: Seconds to wait for a connection and, separately, for each answer.
        attempts: Tries of each request before its error is raised: a connection that fails or times out, and the
            answers 429, 503 and 504, are tried again after 2, 4, ... s (``dicomweb-client``'s backing off).
        environ: Where credentials are read (default ``os.environ``).
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = TIMEOUT_S,
        attempts: int = ATTEMPTS,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        import requests
        from dicomweb_client.api import DICOMwebClient

        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        headers, auth, self.sent = credentials(environ)
        session = requests.Session()
        session.auth = auth
        try:
            self.client = DICOMwebClient(self.url, session=session, headers=headers, timeout=timeout_s)
        except ValueError as err:  # a malformed URL or an unsupported scheme
            raise ValueError(f"DICOMweb URL {url!r}: {err}; expected e.g. http://localhost:8042/dicom-web") from err
        self.attempts = attempts
        self.client.set_http_retry_params(retry=attempts > 1, max_attempts=attempts)

    @property
    def _tries(self) -> str:
        return "1 try" if self.attempts == 1 else f"{self.attempts} tries"

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
                "answer (is the URL the DICOMweb root, e.g. .../dicom-web?)"
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
