"""What tests share: run recipes and environments, the stand-in worker, local servers, scan
inputs. Importable as `helpers.*` (tests/ is on sys.path, see conftest.py)."""
