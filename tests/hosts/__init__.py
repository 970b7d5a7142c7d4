"""The multi-host suite (issue #41): hosts made of network namespaces running what the
Kubernetes manifests run, and faults made by cutting their links."""
