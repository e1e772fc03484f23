"""SIP signalling for the gateway: sans-I/O codecs and user agent cores, and the UDP endpoint.

- :mod:`gateway.sip.message`: SIP messages (RFC 3261), header helpers, response and request
  building, dialog routing.
- :mod:`gateway.sip.sdp`: SDP parsing (RFC 4566) and the offer/answer model (RFC 3264), both
  sides.
- :mod:`gateway.sip.digest`: HTTP Digest authentication (RFC 3261 22, RFC 8760): the server's
  stateless check and the client's credentials.
- :mod:`gateway.sip.rtp`: RTP packets, sender and receiver statistics, RFC 4733 events.
- :mod:`gateway.sip.uas`: the user agent server core (calls in); :mod:`gateway.sip.endpoint`
  is its asyncio UDP shell, bound to the call lifecycle.
- :mod:`gateway.sip.uac`: the user agent client core (a call out, as a phone places it); the
  load simulator's phone (:mod:`gateway.loadsim.sip_caller`) is its shell.
"""
