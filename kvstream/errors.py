"""TEMPORARY until the layout commit lands on main (the lead owns this file)."""
class KVStreamError(Exception):
    pass
class LocalProtocolError(KVStreamError):
    pass
class RemoteProtocolError(KVStreamError):
    pass
