"""servelab's in-repo plugins, registered through the same entry points a third-party package uses."""
