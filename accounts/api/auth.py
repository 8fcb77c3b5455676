"""DRF's side of the API tokens (`Authorization: Token <key>`): the cold endpoints' authentication.
The hot front door verifies the same tokens through the same service (accounts.services.tokens)."""

from __future__ import annotations

from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed

from accounts.services.tokens import INVALID_TOKEN, admit, principal_for_key


class TrainerTokenAuthentication(BaseAuthentication):
    """DRF's side of the same tokens: the principal becomes `request.user`, admitted by its
    project's rate limit."""

    keyword = b"token"

    def authenticate(self, request):
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != self.keyword:
            return None
        if len(parts) != 2:
            raise AuthenticationFailed("Authorization header must be 'Token <key>'.", code="invalid_token")
        principal = principal_for_key(parts[1].decode(errors="replace"))
        if principal is None:
            raise AuthenticationFailed(INVALID_TOKEN, code="invalid_token")
        admit(principal)
        return principal, None

    def authenticate_header(self, request):
        return "Token"
