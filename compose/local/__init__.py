"""The local stack of `meshserve up`: one process per service on this machine, supervised."""
