"""Writes to projects, their members and their tokens, and the checks at the edge that use them
(token verification, rate limits). Plain functions named <entity>_<action>."""
