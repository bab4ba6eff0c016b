"""Cluster deployment: KubeRay and cluster-launcher manifests, their sync tool, the GPU check."""
