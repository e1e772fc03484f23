"""SIP signalling for the gateway: sans-I/O message, SDP and digest-auth codecs.

- :mod:`gateway.sip.message`: SIP messages (RFC 3261), header helpers, response building.
- :mod:`gateway.sip.sdp`: SDP parsing (RFC 4566) and the offer/answer model (RFC 3264).
- :mod:`gateway.sip.digest`: stateless HTTP Digest authentication (RFC 3261 22, RFC 8760).
"""
